"""`Verifiers`: a verifiers 0.4.0 environment (`vf.Env`) played by an astranb policy.

    episode(ctx, sample)
      task = the taskset's task the sample names (its row: prompt, answer, info fields)
      episode = env.run_episode(task, model)     verifiers' own episode: its `run()` (one
                  agent rollout for a plain taskset; a game or a user turn by turn for an env
                  that overrides it), each rollout its chat loop over the interception server,
                  the task's tool servers, its `@vf.stop`s and limits, then scoring
      model = this episode's OpenAI-compatible endpoint for "agent" (ctx.openai_base_url):
              every model call of the rollout is a turn of the episode, sampled by the policy
      reward = the trainable traces' reward (the weighted sum of the task's `@vf.reward`s)
      every reward and metric of every trace: the episode's "verifiers" tool call (exact
      values) and its counts (`count/reward_milli/<name>`, `count/metric_milli/<name>`)

verifiers runs an agent as a program in a runtime. astranb plays every seat with `LocalChat`
(harness.py): verifiers' tool-using chat loop, the `null` harness's program, run by this Python in
a subprocess runtime, so nothing is installed or downloaded at run time. A harness that installs
another program (codex, claude_code, ...) needs a container and the network, and is refused.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping
from typing import Any

from astranb import Environment, SamplingParams

from .harness import HARNESS_ID, local_chat_config

__all__ = ["Verifiers"]

_CHAT_HARNESSES = ("null", "bash", HARNESS_ID)
"""Harness ids astranb plays with its chat loop: `null` is that loop; `bash`, verifiers'
default for a taskset that names none, is the loop with a host shell tool, left out here."""


class Verifiers(Environment):
    """A verifiers environment: its taskset's tasks as samples, its rollouts sampling from the
    policy wired to "agent", its rewards as the reward.

    A sample is {"index": the task's position in the taskset, "key": verifiers' task key,
    "task": the task's data as JSON (prompt, system prompt, and the taskset's own fields such
    as the answer)}. An episode is verifiers' `env.run_episode(task, model)` with the model at
    this episode's endpoint: single-turn (a prompt, a reply), multi-turn (an `Env` whose `run()`
    answers the agent turn by turn through `agent.interaction(task)`), and tool use (the task's
    `toolsets()`: MCP servers whose tools the chat loop calls when a reply has tool calls). The
    reward is the trainable traces' `trace.reward` (their mean when several seats train); every
    `@vf.reward` and `@vf.metric` value is kept in the episode (the "verifiers" tool call and
    `count/reward_milli/<name>`, `count/metric_milli/<name>`, in thousandths). A rollout that
    verifiers marks failed fails the episode with verifiers' error; the run goes on.

    Args:
        env: a `vf.Env` instance (e.g. `vf.load_environment(vf.resolve_env_config({"taskset":
            {"id": "my-taskset"}}))`), or an installed verifiers taskset id (that call is made
            here). Every agent seat is rebuilt to play with astranb's chat loop in a subprocess
            runtime; the seat's other settings (max_turns, token limits, timeouts) stay.
        limit: most tasks read from the taskset (a taskset may be endless).
        seed: the order samples are served in each epoch.
        sampling: SamplingParams, or a dict of its fields: the defaults of the endpoint's
            calls (default: max_new_tokens=256); a call's own max_tokens, temperature, ...
            override them.
        max_episode_tokens: most tokens sampled over the episode (None: the context only).

    Raises:
        TypeError: `env` is neither a `vf.Env` nor a taskset id.
        ValueError: a taskset id verifiers cannot load, a seat pinned to a harness astranb
            cannot run, taskset-level shared tool servers, or an empty taskset.

    Example:
        import verifiers.v1 as vf
        config = vf.resolve_env_config({"taskset": {"id": "reverse_tasks"}})  # README's module
        env = ab.environments.load("verifiers", env=vf.load_environment(config))
        session.wire(env, agent=policy)
        run = session.train(steps=2)
        run.episodes[0].tool_calls[-1]["result"]["traces"][0]["rewards"]   # every reward
    """

    roles = ("agent",)

    def __init__(self, env: Any, *, limit: int = 10_000, seed: int = 0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        self.env = _local(_as_env(env))
        if self.env.taskset.toolsets(self.env.taskset.config):
            raise ValueError(
                f"{type(self.env.taskset).__name__} serves taskset-level shared tool servers "
                "(Taskset.toolsets); astranb runs episodes concurrently, each with its own "
                "servers: declare the tools on the task (Task.toolsets) instead")
        self.tasks = list(itertools.islice(iter(self.env.taskset), limit))
        if not self.tasks:
            raise ValueError(f"{type(self.env.taskset).__name__} yielded no tasks")
        self.seed = seed
        self.sampling = SamplingParams.of(sampling, max_new_tokens=256)
        self.max_episode_tokens = max_episode_tokens

    @property
    def name(self) -> str:
        return f"verifiers:{self.env.config.env_id}"

    # -- samples ----------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Every task once per epoch, in an order drawn from `seed`."""
        for epoch in itertools.count():
            order = list(range(len(self.tasks)))
            random.Random(f"verifiers-{self.seed}-{seed}-{epoch}").shuffle(order)
            for i in order:
                yield self.sample(i)

    def sample(self, index: int) -> dict[str, Any]:
        """The sample of the taskset's `index`th task."""
        task = self.tasks[index]
        return {"index": index, "key": task.key,
                "task": task.data.model_dump(mode="json", exclude_none=True)}

    # -- an episode -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        from verifiers.v1 import ModelContext
        from verifiers.v1.clients import EvalClientConfig

        task = self._task(sample)
        # the token is in the URL; verifiers reads a key from an env var it names, unset here
        client = EvalClientConfig(base_url=ctx.openai_base_url("agent"),
                                  api_key_var="ASTRANB_VERIFIERS_NO_KEY")
        episode = await self.env.run_episode(task, ModelContext(model="agent", client=client))
        scores = _scores(episode)
        await ctx.tool("verifiers", lambda: scores)
        for trace in scores["traces"]:
            for name, reward in trace["rewards"].items():
                ctx.count(f"reward_milli/{name}", round(reward["score"] * 1000))
            for name, value in trace["metrics"].items():
                if isinstance(value, (int, float)):
                    ctx.count(f"metric_milli/{name}", round(value * 1000))
        if ctx.truncation is not None:  # an endpoint call hit the context or token budget
            raise ctx.truncation
        if not episode.ok:
            raise RuntimeError(f"verifiers' episode of task {sample.get('index')} failed: "
                               f"{scores['errors'] or 'no trace completed'}")
        return scores["reward"]

    def _task(self, sample: Mapping[str, Any]) -> Any:
        index = sample.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise ValueError(f"a verifiers sample names a task by index 0..{len(self.tasks) - 1}"
                             f" (Verifiers.sample(i)), got {index!r}")
        task = self.tasks[index]
        if sample.get("key", task.key) != task.key:
            raise ValueError(f"sample {index} was made from another taskset (its key differs)")
        return task


def _as_env(env: Any) -> Any:
    import verifiers.v1 as vf

    if isinstance(env, vf.Env):
        return env
    if isinstance(env, str):
        try:
            return vf.load_environment(vf.resolve_env_config({"taskset": {"id": env}}))
        except (ModuleNotFoundError, TypeError, AttributeError) as error:
            raise ValueError(
                f"verifiers cannot load a taskset {env!r} ({error}); install its package "
                "(a verifiers taskset is a Python package exporting its Taskset), or pass "
                "env=<a vf.Env>") from error
    raise TypeError(f"env must be a verifiers Env (verifiers.v1.Env, e.g. from "
                    f"vf.load_environment) or a taskset id, got {type(env).__name__}")


def _local(env: Any) -> Any:
    """`env` rebuilt with every seat playing astranb's chat loop in a subprocess runtime."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.configs.env import default_agent_harness
    from verifiers.v1.runtimes import SubprocessConfig

    config, seats = env.config, {}
    default = default_agent_harness(config.taskset.id)
    for name, seat in agent_config_fields(config).items():
        harness = seat.harness if seat.harness is not None else default
        if harness.id not in _CHAT_HARNESSES:
            raise ValueError(
                f"seat {name!r} of {type(env).__name__} plays verifiers' {harness.id!r} harness"
                f"{'' if seat.harness is not None else ' (its taskset bundles it)'}; astranb "
                f"plays verifiers' chat loop only (harness 'null', with the task's tools): pin "
                f"the seat to it, AgentConfig(harness={{'id': 'null'}})")
        fields = harness.model_dump(exclude={"id"}) if harness.id != "bash" else {}
        seats[name] = seat.model_copy(update={"harness": local_chat_config(**fields),
                                              "runtime": SubprocessConfig()})
    return type(env)(config.model_copy(update=seats))


def _scores(episode: Any) -> dict[str, Any]:
    """Every trace's rewards and metrics, and the reward of the trainable ones."""
    traces = [{"agent": t.agent.name if t.agent else None,
               "trainable": bool(t.agent.trainable) if t.agent else True,
               "reward": float(t.reward), "stop": t.stop_condition,
               "rewards": {k: {"score": float(r.score), "weight": float(r.weight)}
                           for k, r in t.rewards.items() if r is not None},
               "metrics": dict(t.metrics),
               "errors": [f"{e.type}: {e.message}" for e in t.errors]}
              for t in episode.traces]
    trained = [t["reward"] for t in traces if t["trainable"]] or [0.0]
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    errors += [e for t in traces for e in t["errors"]]
    return {"reward": sum(trained) / len(trained), "ok": bool(episode.ok), "errors": errors,
            "traces": traces}
