"""The verifiers adapter against the real verifiers 0.4.0: tasksets defined here over in-test
datasets (datasets.Dataset.from_list), played by scripted replies through each episode's
OpenAI-compatible endpoint. A single-turn task scored by two rewards and a metric (each value
kept in the episode), a multi-turn env that answers the agent turn by turn, a task whose tool
server the scripted reply calls, hostile replies, clear errors, and a short training run.
verifiers' chat loop runs as a subprocess of this Python (astranb_verifiers.LocalChat): no uv,
no network."""

from __future__ import annotations

import itertools
import sys
import types

import anyio
import pytest
import verifiers
import verifiers.v1 as vf
from astranb_verifiers import HARNESS_ID, LocalChat, Verifiers
from datasets import Dataset

import astranb as ab
from tests.test_math_env import scripted

# -- tasksets defined here ----------------------------------------------------------------------
# verifiers loads a taskset (and the env that goes with it) by module name: each one below is
# registered as a module of its own, as an installed taskset package would be.
ROWS = [{"question": "What is 2 + 3?", "answer": "5"},
        {"question": "What is 4 * 2?", "answer": "8"},
        {"question": "What is 9 - 7?", "answer": "2"}]


def _register(name, *classes):
    module = types.ModuleType(name)
    for cls in classes:
        setattr(module, cls.__name__, cls)
    module.__all__ = [cls.__name__ for cls in classes]
    sys.modules[name] = module
    return name


class QA(vf.TaskData):
    answer: str


class Arithmetic(vf.Task[QA]):
    """Two rewards (the answer, weight 1; brevity, weight 0.5) and a metric."""

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return 1.0 if len(trace.last_reply) <= 3 else 0.25

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticSet(vf.Taskset[Arithmetic]):
    def load(self):
        for row in Dataset.from_list(ROWS):
            yield Arithmetic(QA(prompt=row["question"], answer=row["answer"]), self.config.task)


ARITHMETIC = _register("astranb_test_vf_arithmetic", ArithmeticSet)


def env_of(taskset_id, **config):
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": taskset_id}, **config}))


def play(env, sample, *texts):
    policy = scripted("p", *texts)
    trajectory = anyio.run(ab.play_episode, env, {"agent": policy}, sample)
    return trajectory, policy


def scores(trajectory):
    (call,) = [c for c in trajectory.tool_calls if c.name == "verifiers"]
    return call.result


@pytest.fixture(scope="module")
def arithmetic():
    return ab.environments.load("verifiers", env=env_of(ARITHMETIC))


# -- single turn --------------------------------------------------------------------------------
def test_a_single_turn_task_scores_by_its_rewards_each_value_kept(arithmetic):
    assert isinstance(arithmetic, Verifiers)
    sample = arithmetic.sample(0)
    assert sample["task"]["prompt"] == "What is 2 + 3?" and sample["task"]["answer"] == "5"
    trajectory, policy = play(arithmetic, sample, "5")
    assert trajectory.ok, trajectory.error
    assert len(trajectory.turns) == 1 and "What is 2 + 3?" in policy.engine.prompts[0]
    assert trajectory.rewards == {"agent": 1.5}              # 1 * 1.0 + 0.5 * 1.0
    (trace,) = scores(trajectory)["traces"]
    assert trace["rewards"] == {"correct": {"score": 1.0, "weight": 1.0},
                                "brief": {"score": 1.0, "weight": 0.5}}
    assert trace["metrics"] == {"reply_chars": 1.0}
    assert trajectory.counts["reward_milli/correct"] == 1000
    assert trajectory.counts["metric_milli/reply_chars"] == 1000


def test_a_wrong_long_answer_gets_the_partial_rewards(arithmetic):
    trajectory, _ = play(arithmetic, arithmetic.sample(1), "It is nine.")
    assert trajectory.ok, trajectory.error
    assert trajectory.rewards == {"agent": 0.125}            # 0 * 1.0 + 0.5 * 0.25
    (trace,) = scores(trajectory)["traces"]
    assert trace["rewards"]["correct"]["score"] == 0.0
    assert trace["rewards"]["brief"]["score"] == 0.25
    assert trace["metrics"] == {"reply_chars": 11.0}


# -- multi-turn: an env that answers each reply -------------------------------------------------
class Secret(vf.TaskData):
    answer: int


class Guess(vf.Task[Secret]):
    @vf.reward
    async def found(self, task, trace) -> float:
        return float(trace.last_reply == str(task.answer))

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(trace.num_turns)


class GuessSet(vf.Taskset[Guess]):
    def load(self):
        for row in Dataset.from_list([{"answer": 7}, {"answer": 3}]):
            yield Guess(Secret(prompt="Guess my number from 1 to 9. Reply with the number only.",
                               answer=row["answer"]), self.config.task)


class GuessEnv(vf.Env[vf.SingleAgentEnvConfig]):
    """Says "higher" or "lower" after each wrong guess, up to four guesses."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()                      # the prompted task opens
            for _ in range(3):
                reply = segment.last_reply
                if segment.terminated or reply == str(task.data.answer):
                    break
                hint = "higher" if reply.isdigit() and int(reply) < task.data.answer else "lower"
                segment = await chat.turn(hint)


GUESS = _register("astranb_test_vf_guess", GuessSet, GuessEnv)


def test_a_multi_turn_env_answers_the_agent_turn_by_turn():
    env = ab.environments.load("verifiers", env=env_of(GUESS))
    assert isinstance(env.env, GuessEnv)
    trajectory, policy = play(env, env.sample(0), "4", "8", "7")
    assert trajectory.ok, trajectory.error
    assert len(trajectory.turns) == 3 and trajectory.rewards == {"agent": 1.0}
    assert "higher" in policy.engine.prompts[1] and "lower" in policy.engine.prompts[2]
    (trace,) = scores(trajectory)["traces"]
    assert trace["rewards"]["found"]["score"] == 1.0 and trace["metrics"]["guesses"] == 3.0
    # each turn's request extends the last with the reply as returned: no history retokenized
    assert trajectory.counts.get("retokenized", 0) == 0
    assert policy.engine.prompts[2].startswith(policy.engine.prompts[1])


# -- tools: the task's tool server, called by the model ------------------------------------------
class Sum(vf.Task[QA]):
    @classmethod
    def toolsets(cls, config):
        from tests.verifiers_tools import Calculator

        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class SumSet(vf.Taskset[Sum]):
    def load(self):
        for row in Dataset.from_list(ROWS[:1]):
            yield Sum(QA(prompt=row["question"] + " Use the calculator.", answer=row["answer"]),
                      self.config.task)


SUM = _register("astranb_test_vf_sum", SumSet)
CALL = '<tool_call>\n{"name": "calculator_add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture
def tool_server_path(monkeypatch):
    """verifiers starts the tool server as `python -m tests.verifiers_tools` in the runtime's
    own directory: the repository root on its path lets it import the module."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", root)


def test_a_tool_call_in_a_reply_runs_the_task_s_tool(tool_server_path):
    env = ab.environments.load("verifiers", env=env_of(SUM))
    trajectory, policy = play(env, env.sample(0), CALL, "5")
    assert trajectory.ok, trajectory.error
    assert len(trajectory.turns) == 2 and trajectory.rewards == {"agent": 1.0}
    assert "calculator_add" in policy.engine.prompts[0]     # the tool's schema, advertised
    assert "5" in policy.engine.prompts[1].split(CALL)[-1]   # its result, the next prompt
    (trace,) = scores(trajectory)["traces"]
    assert trace["metrics"]["tool_calls"] == 1.0


# -- hostile replies ----------------------------------------------------------------------------
HOSTILE = ["9" * 5000, "\x00\x1b[2J\u202e\ud7ff\x7f 5 \r\n\t",
           '<tool_call>\n{"name": "os_system", "arguments": {"cmd": "rm -rf /"}}\n</tool_call>',
           "<tool_call>\n{not json at all\n</tool_call>", "</tool_call><tool_call>"]


@pytest.mark.parametrize("text", HOSTILE, ids=["huge", "control", "fake_tool", "broken_call",
                                               "stray_tags"])
def test_hostile_replies_are_only_text_to_the_task(arithmetic, text):
    # no tool is offered, so a tool call in the reply is text; the huge reply stops at
    # max_new_tokens (256); every one is scored by the rewards like any wrong answer
    trajectory, _ = play(arithmetic, arithmetic.sample(0), text, "5")
    assert trajectory.ok, trajectory.error
    assert len(trajectory.turns) == 1 and trajectory.rewards == {"agent": 0.125}
    (trace,) = scores(trajectory)["traces"]
    assert trace["stop"] == "agent_completed" and trace["errors"] == []


@pytest.mark.slow  # a tool server starts per episode (about 40 s on 2 cores)
def test_a_call_to_a_tool_the_task_has_not_is_answered_as_an_error(tool_server_path):
    env = ab.environments.load("verifiers", env=env_of(SUM))
    fake = '<tool_call>\n{"name": "os_system", "arguments": {"cmd": "rm -rf /"}}\n</tool_call>'
    trajectory, policy = play(env, env.sample(0), fake, "5")
    assert trajectory.ok, trajectory.error
    assert len(trajectory.turns) == 2 and trajectory.rewards == {"agent": 1.0}
    # the chat loop answers the call with an error naming the tool, and the model goes on
    assert "os_system" in policy.engine.prompts[1].split("rm -rf /")[-1]


# -- errors ---------------------------------------------------------------------------------------
def test_every_seat_plays_verifiers_chat_loop_with_this_python(arithmetic):
    from verifiers.v1.utils.loaders import load_harness

    seat = arithmetic.env.config.agent
    assert seat.harness.id == HARNESS_ID and seat.runtime.type == "subprocess"
    assert isinstance(load_harness(seat.harness), LocalChat)   # verifiers finds it by its id


def test_the_package_exports_and_the_main_signature():
    import inspect

    import astranb_verifiers

    assert astranb_verifiers.__all__ == ["HARNESS_ID", "LocalChat", "Verifiers",
                                         "local_chat_config"]
    assert str(inspect.signature(Verifiers)) == (
        "(env: 'Any', *, limit: 'int' = 10000, seed: 'int' = 0, "
        "sampling: 'SamplingParams | Mapping[str, Any] | None' = None, "
        "max_episode_tokens: 'int | None' = None)")


def test_an_unknown_taskset_or_a_wrong_env_says_what_to_pass():
    with pytest.raises(ValueError, match="cannot load a taskset 'no-such-taskset'.*install"):
        ab.environments.load("verifiers", env="no-such-taskset")
    with pytest.raises(TypeError, match="must be a verifiers Env"):
        ab.environments.load("verifiers", env={"taskset": "gsm8k"})
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        ab.environments.load("verifiers", env=env_of(ARITHMETIC), limit=0)


def test_a_seat_on_a_program_harness_is_refused_with_the_fix():
    env = env_of(ARITHMETIC, agent={"harness": {"id": "codex"}})
    with pytest.raises(ValueError, match="'codex' harness.*harness=\\{'id': 'null'\\}"):
        Verifiers(env)


class Nothing(vf.Taskset[Arithmetic]):
    def load(self):
        return iter(())


NOTHING = _register("astranb_test_vf_nothing", Nothing)


def test_an_empty_taskset_and_a_foreign_sample_are_errors(arithmetic):
    with pytest.raises(ValueError, match="yielded no tasks"):
        Verifiers(env_of(NOTHING))
    trajectory, _ = play(arithmetic, {"index": 99}, "5")
    assert not trajectory.ok and "names a task by index 0..2" in trajectory.error
    trajectory, _ = play(arithmetic, {**arithmetic.sample(0), "key": "other"}, "5")
    assert not trajectory.ok and "another taskset" in trajectory.error


def test_a_taskset_id_loads_its_env_as_vf_load_environment_does():
    env = ab.environments.load("verifiers", env=ARITHMETIC, limit=2)
    assert type(env.env) is vf.SingleAgentEnv and len(env.tasks) == 2
    assert env.name == f"verifiers:{ARITHMETIC}"
    assert env.registry_kwargs == {"env": ARITHMETIC, "limit": 2}   # a service rebuilds it


def test_samples_are_every_task_once_per_epoch(arithmetic):
    samples = list(itertools.islice(arithmetic.samples(0), 6))
    assert sorted(s["index"] for s in samples[:3]) == [0, 1, 2]
    assert sorted(s["index"] for s in samples[3:]) == [0, 1, 2]
    assert [s["index"] for s in itertools.islice(arithmetic.samples(0), 3)] == \
        [s["index"] for s in samples[:3]]
    assert verifiers.__version__ == "0.4.0"


# -- the README's table row, and a short training run ---------------------------------------------
def test_the_readme_table_row_is_true(arithmetic, monkeypatch):
    from astranb.environments import openai_endpoint
    from tests.test_reasoning_gym_env import readme_row

    row = readme_row("verifiers")
    streamed = []

    def chunked(answer):
        streamed.append(answer)
        return real(answer)

    real = openai_endpoint.chunked
    monkeypatch.setattr(openai_endpoint, "chunked", chunked)
    trajectory, policy = play(arithmetic, arithmetic.sample(1), "8 or so")
    # multi-turn and tools: test_a_multi_turn_env_... and test_a_tool_call_in_a_reply_...
    assert row["multi-turn"].startswith("yes") and row["tools"].startswith("yes")
    assert "<tools>" not in policy.engine.prompts[0]          # a task without tool servers
    assert row["multi-agent"].startswith("no") and arithmetic.roles == ("agent",)
    assert row["streaming"].startswith("yes") and len(streamed) == 1   # the chat loop streams
    assert row["partial rewards"].startswith("yes")
    assert trajectory.rewards == {"agent": 0.125}                      # brief's 0.25, weighted


@pytest.mark.slow  # a real engine and trainer; a chat-loop process per episode
def test_a_short_training_run_plays_and_trains_end_to_end(tmp_path):
    with ab.Session(tmp_path, trainer="thread") as session:
        policy = session.policy("p", model=ab.models.tiny_chat(), max_batch_size=32,
                                algorithm=ab.GRPO(entropy_coef=0.01, filter_groups=False))
        env = ab.environments.load("verifiers", env=env_of(ARITHMETIC),
                                   sampling={"max_new_tokens": 8})
        session.wire(env, agent=policy)
        run = session.train(steps=2, batch_size=4, group_size=2)
        run.wait(timeout=400, progress=False)
        assert run.status == "finished", run.status
        rows = run.rows
    assert len(rows) == 2 and {r["policy"] for r in rows} == {"p"}
    # every episode was scored by both rewards (an untrained model's reply is never "5")
    assert all("count/reward_milli/brief" in r for r in rows)
