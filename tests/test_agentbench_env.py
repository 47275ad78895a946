"""The AgentBench adapter against a fake controller that follows AgentBench's HTTP protocol
(astranb_agentbench/fake.py): start a sample, interact turn by turn, cancel, read the result and
reward; a controller that is down ends only the episode."""

from __future__ import annotations

import httpx
import pytest
from astranb_agentbench import AgentBench, default_reward
from astranb_agentbench.fake import TASK, FakeController, secret

import astranb as ab
from tests.test_math_env import play, scripted


@pytest.fixture
def fake():
    return FakeController()


def make(fake, **kw):
    return AgentBench(TASK, controller="http://controller/api",
                      transport=httpx.ASGITransport(fake.app), **kw)


def test_a_right_first_guess_completes_with_reward_1(fake):
    env = make(fake, indices=[3])
    agent = scripted("a", f"ACTION: {secret(3)}")
    trajectory = play(env, {"index": 3}, agent=agent)
    assert trajectory.rewards == {"agent": 1.0} and trajectory.error is None
    assert [c.name for c in trajectory.tool_calls] == ["start_sample", "interact"]
    assert trajectory.tool_calls[1].result["output"]["result"] == {"result": 1, "guesses": 1}
    prompt = agent.engine.prompts[0]  # the server's history, agent turns as the assistant's
    assert "Guess my number" in prompt and "<|im_start|>assistant\nOK." in prompt
    assert fake.cancelled == [] and fake.sessions == {}


def test_turn_by_turn_the_model_reads_each_observation(fake):
    target = secret(4)  # 9
    env = make(fake)
    agent = scripted("a", "ACTION: 5", "ACTION: 8", f"ACTION: {target}")
    trajectory = play(env, {"index": 4}, agent=agent)
    assert trajectory.rewards == {"agent": 1.0} and len(trajectory.turns) == 3
    assert agent.engine.prompts[1].rstrip().endswith("higher<|im_end|>\n<|im_start|>assistant")
    assert "ACTION: 5" in agent.engine.prompts[1]


@pytest.mark.parametrize("replies, counts", [
    (["I am not sure"], {"status/agent_invalid_action": 1}),
    (["ACTION: 1"] * 5, {"status/task_limit_reached": 1}),
])
def test_unfinished_samples_score_0_and_say_why(fake, replies, counts):
    assert secret(4) == 9
    env = make(fake)
    trajectory = play(env, {"index": 4}, agent=scripted("a", *replies))
    assert trajectory.rewards == {"agent": 0.0} and dict(trajectory.counts) == counts
    assert fake.cancelled == [] and fake.sessions == {}  # the server ended them itself


def test_a_sample_out_of_turns_is_cancelled_on_the_server(fake):
    env = make(fake, max_turns=2)
    trajectory = play(env, {"index": 4}, agent=scripted("a", "ACTION: 1", "ACTION: 2"))
    assert trajectory.rewards == {"agent": 0.0}
    assert dict(trajectory.counts) == {"out_of_turns": 1}
    assert fake.cancelled == [0] and fake.sessions == {}


def test_a_controller_that_is_down_ends_only_the_episode():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    env = AgentBench(TASK, transport=httpx.MockTransport(refuse), indices=[0])
    trajectory = play(env, {"index": 0}, agent=scripted("a", "ACTION: 1"))
    assert trajectory.rewards == {"agent": 0.0} and trajectory.error is None
    assert dict(trajectory.counts) == {"task_server_error": 1}
    assert "did not answer /start_sample: ConnectError" in trajectory.tool_calls[0].error


def test_a_controller_error_midway_cancels_nothing_it_cannot_and_scores_0(fake):
    env = AgentBench("no-such-task", controller="http://controller/api",
                     transport=httpx.ASGITransport(fake.app), indices=[0])
    trajectory = play(env, {"index": 0}, agent=scripted("a"))
    assert dict(trajectory.counts) == {"task_server_error": 1}
    assert "406" in trajectory.tool_calls[0].error and "Task does not exist" in \
        trajectory.tool_calls[0].error


def test_indices_come_from_the_controller_when_not_given(fake):
    env = make(fake, test_indices=[8, 9])
    assert env.splits == ("train", "test")
    first = next(iter(env.samples(seed=0)))
    assert first == {"index": None}
    trajectory = play(env, first, agent=scripted("a", f"ACTION: {secret(0)}"))
    assert trajectory.rewards == {"agent": 1.0}
    assert env.indices == list(range(10))
    train = [s["index"] for s, _ in zip(env.samples(seed=1), range(8), strict=False)]
    assert sorted(train) == list(range(8))  # the test indices are held out
    assert [s["index"] for s in env.split_samples("test")] == [8, 9]


def test_default_reward_reads_each_tasks_result():
    assert default_reward("completed", {"result": True}) == 1.0        # ALFWorld, OS
    assert default_reward("completed", {"reward": 0.75}) == 0.75       # WebShop
    assert default_reward("task limit reached", {"result": 0}) == 0.0
    assert default_reward("completed", None) == 0.0
    assert default_reward("completed", 1) == 1.0


def test_loads_by_name(fake):
    env = ab.environments.load("agentbench", task=TASK, indices=[0, 1])
    assert isinstance(env, AgentBench) and env.name == f"AgentBench[{TASK}]"
    with pytest.raises(ValueError, match="max_turns"):
        AgentBench(TASK, max_turns=0)
