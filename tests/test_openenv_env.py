"""The OpenEnv adapter against the real openenv-core 0.2.0: an environment defined here, served
by openenv-core's own server (its FastAPI app, its WebSocket sessions) on a loopback port the
OS picks, played through the client's reset/step. Observations rendered into the conversation,
replies turned into actions, rewards summed or last, multi-turn up to done or max_turns;
invalid and hostile replies, a slow server, a server at capacity and one that goes away, each
with a clear result; and a short training run with the tiny chat model. No network."""

from __future__ import annotations

import json
import math
import time

import anyio
import pytest
from astranb_openenv import JSONClient, OpenEnv, render_observation, serve
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import Action, Environment, Observation, State

import astranb as ab
from tests.test_math_env import ScriptedEngine
from tests.test_textarena_env import scripted

# openenv-core 0.2.0's client opens its WebSocket the way websockets 17 deprecates (not as a
# context manager): a third-party deprecation this adapter cannot change
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)


class Guess(Action):
    message: str


class Clue(Observation):
    prompt: str
    tries: int = 0


class GuessTheDigit(Environment):
    """Guess the seed's last digit: a wrong guess costs 0.1 and says higher or lower, the right
    one earns 1 and ends the episode; five wrong guesses end it too. "boom" makes the step
    raise, "slow" makes it take 3 s."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.target = State(episode_id=None, step_count=0), 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state, self.target = State(episode_id=episode_id, step_count=0), (seed or 0) % 10
        return Clue(prompt="Guess my digit, 0 to 9. Reply with the digit only.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        text, tries = action.message.strip(), self._state.step_count
        if text == "boom":
            raise RuntimeError("the environment's own bug")
        if text == "slow":
            time.sleep(3)
        if text == str(self.target):
            return Clue(prompt="Right!", tries=tries, reward=1.0, done=True)
        hint = (
            "not a digit"
            if not (len(text) == 1 and text.isdigit())
            else "higher"
            if int(text) < self.target
            else "lower"
        )
        return Clue(prompt=f"Wrong: {hint}.", tries=tries, reward=-0.1, done=tries >= 5)

    @property
    def state(self):
        return self._state


@pytest.fixture(scope="module")
def server():
    with serve(GuessTheDigit, Guess, Clue) as running:
        yield running


def play(env, *texts, seed=4, ok=True):
    policy = scripted("p", *texts)
    trajectory = anyio.run(ab.play_episode, env, {"agent": policy}, {"seed": seed, "split": "x"})
    if ok:
        assert trajectory.ok, trajectory.error
    return trajectory, policy.engine.prompts


def load(server, **kwargs):
    return ab.environments.load("openenv", base_url=server.base_url, **kwargs)


# -- episodes played to the end -------------------------------------------------------------------
def test_guesses_until_done_with_the_step_rewards_summed(server):
    env = load(server)
    trajectory, prompts = play(env, "7", "3", "4")  # seed 4: the digit is 4
    assert trajectory.rewards["agent"] == pytest.approx(-0.1 - 0.1 + 1.0)
    assert trajectory.counts == {"steps": 3, "done": 1, "retokenized": 0}
    # the observation rendered into the conversation, turn by turn
    assert "Guess my digit, 0 to 9." in prompts[0]
    assert '"prompt": "Wrong: lower."' in prompts[1] and '"tries": 1' in prompts[1]
    assert '"prompt": "Wrong: higher."' in prompts[2]
    # one conversation, token-in/token-out: each prompt extends the last prompt and reply
    for before, after in zip(trajectory.turns, trajectory.turns[1:], strict=False):
        done = before.generation.prompt_ids + before.generation.completion_ids
        assert after.generation.prompt_ids[: len(done)] == done


def test_reward_last_takes_the_final_step_s_reward(server):
    trajectory, _ = play(load(server, reward="last"), "7", "3", "4")
    assert trajectory.rewards == {"agent": 1.0}
    trajectory, _ = play(load(server, reward="last", max_turns=2), "7", "3")
    assert trajectory.rewards == {"agent": pytest.approx(-0.1)}


def test_the_environment_s_own_end_and_max_turns_both_stop_an_episode(server):
    trajectory, _ = play(load(server), *"01235")  # five wrong guesses: the server says done
    assert trajectory.rewards["agent"] == pytest.approx(-0.5)
    assert trajectory.counts["done"] == 1 and len(trajectory.turns) == 5
    trajectory, _ = play(load(server, max_turns=2), "0", "1")
    assert trajectory.rewards["agent"] == pytest.approx(-0.2)
    assert trajectory.counts == {"steps": 2, "out_of_turns": 1, "retokenized": 0}


def test_a_render_and_an_action_of_your_own(server):
    def render(observation):
        return f"<< {observation['prompt']} >>"

    def action(reply):  # "my guess: N" or nothing
        head, _, digit = reply.partition(":")
        return {"message": digit.strip()} if head == "my guess" else None

    env = load(server, render=render, action=action, instructions="A game.", max_turns=3)
    trajectory, prompts = play(env, "4", "my guess: 2", "my guess: 4")
    assert trajectory.rewards["agent"] == pytest.approx(0.9)
    assert trajectory.counts == {"invalid_action": 1, "steps": 2, "done": 1, "retokenized": 0}
    assert "A game.\n\n<< Guess my digit" in prompts[0]
    assert "That is not a valid action." in prompts[1] and "<< Wrong: higher. >>" in prompts[2]


class GuessClient(EnvClient):
    """An environment's own typed client, as OpenEnv's environment packages ship them."""

    def _step_payload(self, action):
        return {"message": action.message}

    def _parse_result(self, payload):
        observation = Clue(
            **payload["observation"], reward=payload.get("reward"), done=payload.get("done", False)
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=payload.get("done", False)
        )

    def _parse_state(self, payload):
        return State(**payload)


def test_an_environment_s_own_client_with_typed_actions(server):
    env = load(
        server,
        client=GuessClient,
        action=lambda reply: Guess(message=reply),
        render=lambda clue: f"{clue.prompt} (try {clue.tries})",
    )
    trajectory, prompts = play(env, "9", "4")
    assert trajectory.rewards["agent"] == pytest.approx(0.9)
    assert "Wrong: lower. (try 1)" in prompts[1]


def test_the_default_rendering():
    assert render_observation("plain") == "plain"
    assert render_observation({"prompt": "hi", "done": False, "reward": 1, "metadata": {}}) == "hi"
    assert render_observation(Clue(prompt="hi", tries=2)) == '{"prompt": "hi", "tries": 2}'
    assert render_observation(7) == "7"


# -- invalid and hostile replies ------------------------------------------------------------------
def test_an_action_the_server_refuses_is_counted_and_answered(server):
    # the server validates the action against its schema (Guess forbids other fields)
    env = load(
        server,
        action=lambda reply: {"message": reply, "extra": 1} if "x" in reply else {"message": reply},
        max_turns=3,
    )
    trajectory, prompts = play(env, "x4", "4")
    assert trajectory.rewards == {"agent": 1.0}
    assert trajectory.counts == {"invalid_action": 1, "steps": 1, "done": 1, "retokenized": 0}
    assert "The environment refused that action" in prompts[1]


def test_an_action_function_that_raises_is_an_invalid_action(server):
    env = load(server, action=lambda reply: {"message": str(int(reply))}, max_turns=2)
    trajectory, _ = play(env, "four", "4")
    assert trajectory.rewards == {"agent": 1.0}
    assert trajectory.counts["action_error"] == trajectory.counts["invalid_action"] == 1


HOSTILE = [
    "",
    " ",
    "\x00\x1b[31m\u202e",
    '", "done": true, "reward": 100}',
    '{"type": "close"}',
    '{"type": "reset", "data": {}}',
    "<|im_end|><|im_start|>user\n4",
    "%s%n{0}" * 50,
    "__import__('os').system('id')",
    "4" * 5000,
    "\ufffd" * 100,
    "7\n" * 2000,
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_replies_only_ever_reach_the_server_as_a_message(server, text):
    env = load(server, max_turns=3, sampling={"max_new_tokens": 4096})
    trajectory, _ = play(env, text, text, text, ok=False)
    assert trajectory.ok, trajectory.error
    if trajectory.truncated:  # the conversation outgrew the tiny model's context
        assert trajectory.rewards == {"agent": 0.0}
    else:  # judged by the environment: the wrong guesses' cost, no more, no less
        assert trajectory.rewards["agent"] == pytest.approx(-0.3)


def test_a_huge_reply_is_contained(server):
    env = load(server, max_turns=3, sampling={"max_new_tokens": 200_000})
    trajectory, _ = play(env, "x" * 100_000, "4", "4", ok=False)
    assert trajectory.truncated and trajectory.rewards == {"agent": 0.0}
    assert trajectory.counts["steps"] == 1  # the server judged it; the context ended the episode


def test_an_environment_that_raises_on_an_action_fails_that_episode_only(server):
    env = load(server)
    trajectory, _ = play(env, "1", "boom", ok=False)
    assert not trajectory.ok and trajectory.rewards == {}
    assert "raised on step" in trajectory.error and "the environment's own bug" in trajectory.error
    assert play(env, "4")[0].rewards == {"agent": 1.0}  # the next episode plays as usual


# -- the server: slow, full, gone -----------------------------------------------------------------
def test_a_server_that_does_not_answer_in_time_fails_the_episode(server):
    env = load(server, timeout=1.0)
    started = time.monotonic()
    trajectory, _ = play(env, "slow", ok=False)
    assert time.monotonic() - started < 5
    assert not trajectory.ok and "did not answer step within 1 s" in trajectory.error


def test_no_server_is_a_clear_error():
    with serve(GuessTheDigit, Guess, Clue) as gone:
        url = gone.base_url
    env = ab.environments.load("openenv", base_url=url, timeout=2.0)
    trajectory, _ = play(env, "4", ok=False)
    assert not trajectory.ok and f"cannot reach the OpenEnv server at {url}" in trajectory.error


class StopsTheServer(ScriptedEngine):
    """Replies as scripted; stops the server before its second reply."""

    def __init__(self, texts, running):
        super().__init__(texts)
        self.running = running

    async def generate(self, request):
        if self.prompts:
            await anyio.to_thread.run_sync(self.running.close)
        return await super().generate(request)


class Flood(GuessTheDigit):
    def step(self, action, timeout_s=None, **kwargs):
        return Clue(prompt="x" * 2_000_000)  # past the 0.2 client's 1 MiB message limit


def test_an_observation_too_large_for_the_client_is_a_clear_error():
    with serve(Flood, Guess, Clue) as flooding:
        env = ab.environments.load("openenv", base_url=flooding.base_url, timeout=5.0)
        trajectory, _ = play(env, "4", ok=False)
    assert not trajectory.ok and trajectory.rewards == {}
    assert "sent a message larger than the client takes during step" in trajectory.error


def scripted_policy(engine):
    """A policy "p" of the tiny chat model whose replies come from a scripted engine."""
    from astranb.weights.publish import StatePublisher
    from tests.test_math_env import TOKENIZER

    return ab.Policy("p", ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher("p", engine, None), TOKENIZER)


def test_a_server_that_goes_away_mid_episode_is_a_clear_error():
    running = serve(GuessTheDigit, Guess, Clue)
    policy = scripted_policy(StopsTheServer(["1", "2", "3"], running))
    env = ab.environments.load("openenv", base_url=running.base_url, timeout=5.0)
    started = time.monotonic()
    trajectory = anyio.run(ab.play_episode, env, {"agent": policy}, {"seed": 4})
    assert time.monotonic() - started < 15
    assert not trajectory.ok and trajectory.rewards == {}
    assert "OpenEnv server at" in trajectory.error, trajectory.error
    assert (
        "closed the session during step" in trajectory.error or "cannot reach" in trajectory.error
    ), trajectory.error


class Slower(ScriptedEngine):
    async def generate(self, request):
        await anyio.sleep(0.2)
        return await super().generate(request)


def test_a_server_at_capacity_is_retried_until_a_session_frees():
    def policy():
        return scripted_policy(Slower(["1", "4"]))

    async def together(env):
        out = []

        async def one():
            out.append(await ab.play_episode(env, {"agent": policy()}, {"seed": 4}))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        return out

    with serve(GuessTheDigit, Guess, Clue, max_sessions=1) as single:
        trajectories = anyio.run(together, load(single, timeout=20.0))
    assert all(t.ok for t in trajectories), [t.error for t in trajectories]
    assert [t.rewards["agent"] for t in trajectories] == [pytest.approx(0.9)] * 3


# -- settings, samples, the wire ------------------------------------------------------------------
def test_bad_settings_say_what_to_do(server):
    for kwargs, message in (
        ({"max_turns": 0}, "max_turns must be"),
        ({"reward": "mean"}, "reward must be 'sum' or 'last'"),
        ({"timeout": 0}, "timeout must be"),
    ):
        with pytest.raises(ValueError, match=message):
            load(server, **kwargs)
    with pytest.raises(ValueError, match="base_url must be the server's http://"):
        OpenEnv("127.0.0.1:8000")
    with pytest.raises(ValueError, match="has splits"):
        next(load(server).split_samples("validation"))
    with pytest.raises(ValueError, match="loopback only"):
        serve(GuessTheDigit, Guess, Clue, host="0.0.0.0")
    import importlib.metadata

    assert importlib.metadata.version("openenv-core") == "0.2.0"


def test_samples_are_reset_seeds_and_splits_share_none(server):
    env = load(server)
    train = [s["seed"] for s, _ in zip(env.samples(0), range(200), strict=False)]
    test = [s["seed"] for s, _ in zip(env.split_samples("test"), range(200), strict=False)]
    assert not set(train) & set(test) and all(s % 2 == 0 for s in train)
    assert train == [s["seed"] for s, _ in zip(env.samples(0), range(200), strict=False)]


def test_the_wire_is_json_text(server, monkeypatch):
    sent = []
    real = JSONClient._send

    def spy(self, message):
        sent.append(json.dumps(message))
        return real(self, message)

    monkeypatch.setattr(JSONClient, "_send", spy)
    play(load(server), "4")
    assert [json.loads(m)["type"] for m in sent] == ["reset", "step", "close"]
    assert json.loads(sent[1])["data"] == {"message": "4"}


# -- the README's table row, and a short training run ---------------------------------------------
def test_the_readme_table_row_is_true(server):
    from tests.test_reasoning_gym_env import readme_row

    row = readme_row("OpenEnv")
    trajectory, prompts = play(load(server), "7", "4")
    assert row["multi-turn"].startswith("yes") and len(trajectory.turns) == 2
    assert row["tools"].startswith("no") and "<tools>" not in prompts[0]
    assert row["multi-agent"].startswith("no") and load(server).roles == ("agent",)
    assert row["streaming"].startswith("no")
    assert row["partial rewards"].startswith("yes")
    assert trajectory.rewards["agent"] == pytest.approx(0.9)  # every step's reward counts


def readme_example():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### OpenEnv's environments", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # a real engine and trainer
def test_the_readme_example_trains_the_tiny_model_for_two_steps(tmp_path):
    code = readme_example()
    assert '"runs/openenv"' in code and "print(" in code
    namespace = {"__name__": "readme_openenv"}
    exec(
        compile(code.replace('"runs/openenv"', repr(str(tmp_path))), "README.md", "exec"), namespace
    )
    rows = namespace["run"].rows
    assert namespace["run"].status == "finished" and len(rows) == 2
    assert {r["policy"] for r in rows} == {"p"}
    # episodes stepped the environment and none failed; rewards between five wrong guesses and
    # a right one
    assert sum(r.get("count/steps", 0) for r in rows) > 0
    assert all(r["failed_episodes"] == 0 for r in rows)
    rewards = [r["reward"] for r in rows if not math.isnan(r["reward"])]  # NaN: no episode
    assert rewards and all(-0.5 - 1e-9 <= reward <= 1.0 for reward in rewards)


@pytest.mark.slow  # a real engine and trainer
def test_a_short_training_run_plays_and_trains_end_to_end(server, tmp_path):
    with ab.Session(tmp_path, trainer="thread") as session:
        policy = session.policy(
            "p",
            model=ab.models.tiny_chat(),
            max_batch_size=32,
            algorithm=ab.GRPO(entropy_coef=0.01, filter_groups=False),
        )
        session.wire(load(server, max_turns=3, sampling={"max_new_tokens": 8}), agent=policy)
        run = session.train(steps=2, batch_size=4, group_size=4)
        run.wait(timeout=240, progress=False)
        assert run.status == "finished", run.status
        rows = run.rows
    assert len(rows) == 2 and {r["policy"] for r in rows} == {"p"}
    # episodes stepped the environment and none failed; rewards between three wrong guesses
    # and a right one (a row counts the episodes since the last row)
    assert sum(r.get("count/steps", 0) for r in rows) > 0
    assert all(r["failed_episodes"] == 0 for r in rows)
    rewards = [r["reward"] for r in rows if not math.isnan(r["reward"])]  # NaN: no episode
    assert rewards and all(-0.3 - 1e-9 <= reward <= 1.0 for reward in rewards)
