"""The AgentBench adapter against a fake controller that follows AgentBench's HTTP protocol
(astranb_agentbench/fake.py): start a sample, interact turn by turn, cancel, read the result and
reward; a controller that is down ends only the episode."""

from __future__ import annotations

import httpx
import pytest
from astranb_agentbench import AgentBench, default_reward
from astranb_agentbench.fake import TASK, FakeController, demonstrations, secret

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
    assert trajectory.rewards == {"agent": 0.0}
    assert dict(trajectory.counts) == {"retokenized": 0, **counts}
    assert fake.cancelled == [] and fake.sessions == {}  # the server ended them itself


def test_a_sample_out_of_turns_is_cancelled_on_the_server(fake):
    env = make(fake, max_turns=2)
    trajectory = play(env, {"index": 4}, agent=scripted("a", "ACTION: 1", "ACTION: 2"))
    assert trajectory.rewards == {"agent": 0.0}
    assert dict(trajectory.counts) == {"retokenized": 0, "out_of_turns": 1}
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


def test_a_controller_with_more_samples_serves_them_all():
    fake = FakeController(samples=30)
    env = make(fake, indices=range(30), test_indices=range(20, 30))
    trajectory = play(env, {"index": 27}, agent=scripted("a", f"ACTION: {secret(27)}"))
    assert trajectory.rewards == {"agent": 1.0}
    assert [s["index"] for s in env.split_samples("test")] == list(range(20, 30))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        FakeController(samples=0)


def test_demonstrations_are_the_conversations_the_adapter_shows(fake):
    tokenizer = ab.models.tiny_chat().tokenizer()
    env = make(fake)
    for demo in demonstrations(12, seed=1, strategy="bisect"):
        messages = demo["messages"]
        guesses = [m["content"] for m in messages if m["role"] == "assistant"][1:]
        target = int(guesses[-1].removeprefix("ACTION: "))  # halving always wins
        index = next(i for i in range(10) if secret(i) == target)
        agent = scripted("a", *guesses)
        trajectory = play(env, {"index": index}, agent=agent)
        assert trajectory.rewards == {"agent": 1.0} and len(guesses) <= 4
        # what the model saw before its last guess is the demonstration up to that guess
        assert agent.engine.prompts[-1] == tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True)


def test_random_demonstrations_win_as_often_as_chance():
    demos = demonstrations(3000, seed=2, strategy="random")
    for demo in demos:
        turns = demo["messages"][3:]
        guesses = [int(m["content"].removeprefix("ACTION: ")) for m in turns[::2]]
        assert [m["role"] for m in turns] == [("assistant", "user")[i % 2]
                                              for i in range(len(turns))]
        assert turns[-1]["role"] == "assistant" and 1 <= len(guesses) <= 5
        assert all(1 <= g <= 10 for g in guesses)
        # some number agrees with every "higher"/"lower" (and, when it stopped early, is the
        # last guess)
        told = [m["content"] for m in turns[1::2]]
        fits = [t for t in range(1, 11) if all((t > g) == (word == "higher") and t != g
                                               for g, word in zip(guesses, told, strict=False))]
        assert fits and (len(guesses) == 5 or guesses[-1] in fits)
    early = sum(1 for d in demos if len(d["messages"]) < 3 + 9)  # won within 4 guesses
    assert abs(early / len(demos) - (1 - 0.9 ** 4)) < 0.03
    with pytest.raises(ValueError, match="strategy"):
        demonstrations(1, strategy="optimal")
