"""The Gymnasium adapter against the real gymnasium 1.4.0: observations rendered as text,
replies parsed into actions (hostile ones included), rewards summed over the steps, invalid
replies counted and bounded, splits that share no start, clear errors, and a short training
run. No network."""

from __future__ import annotations

import anyio
import gymnasium
import pytest
from astranb_gymnasium import ACTION_NAMES, Gymnasium, parse_action, text_of

import astranb as ab
from astranb.weights.publish import StatePublisher
from tests.test_math_env import TOKENIZER, ScriptedEngine

LAKE = {"id": "FrozenLake-v1", "make_kwargs": {"is_slippery": False}}
# the 4x4 map: S F F F / F H F H / F F F H / H F F G; this path reaches G
TO_GOAL = ("down", "down", "right", "right", "down", "right")


def scripted(*texts):
    engine = ScriptedEngine(texts)
    return ab.Policy("p", ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher("p", engine, None), TOKENIZER)


def play(env, *texts):
    policy = scripted(*texts)
    trajectory = anyio.run(ab.play_episode, env, {"agent": policy}, {"seed": 0, "split": "x"})
    assert trajectory.ok, trajectory.error
    return trajectory, policy.engine.prompts


@pytest.mark.parametrize("reply, action", [
    ("down", 1), ("I go LEFT.", 0), ("first up, then right", 2),  # the last one named counts
    ("2", 2), (" 3 ", 3), ("4", None), ("leftover", None), ("upward", None),
    ("left-most", None), ("", None), ("right; __import__('os').system('id')", 2),
    ("{'action': 'down'}", 1), ("down\n" * 1000 + "up", 3),
])
def test_an_action_is_the_last_name_the_reply_says_and_nothing_else(reply, action):
    assert parse_action(reply, ACTION_NAMES["FrozenLake"]) == action


def test_an_ansi_rendering_becomes_plain_text_with_the_agent_s_cell_marked():
    assert text_of("\n\x1b[41mS\x1b[0mFFF\nFHFH\n") == "[S]FFF\nFHFH"
    assert text_of("a\x1b[1;32mb\x1b[0m") == "ab"


def test_the_path_to_the_goal_earns_the_goal_s_reward_turn_by_turn():
    env = ab.environments.load("gymnasium", **LAKE)
    trajectory, prompts = play(env, *TO_GOAL)
    assert trajectory.rewards == {"agent": 1.0}
    assert len(trajectory.turns) == 6
    assert trajectory.counts == {"actions": 6, "terminated": 1, "retokenized": 0}
    assert "down, right, up" in prompts[0] and "[S]FFF" in prompts[0]
    assert "[F]FFH" in prompts[2]  # after down, down: the third row's first cell
    # token-in/token-out across turns: each prompt extends the last prompt and reply
    for before, after in zip(trajectory.turns, trajectory.turns[1:], strict=False):
        done = before.generation.prompt_ids + before.generation.completion_ids
        assert after.generation.prompt_ids[:len(done)] == done


def test_a_hole_ends_the_episode_with_nothing():
    env = ab.environments.load("gymnasium", **LAKE)
    trajectory, _ = play(env, "right", "down")  # (0,1) then the hole at (1,1)
    assert trajectory.rewards == {"agent": 0.0}
    assert trajectory.counts == {"actions": 2, "terminated": 1, "retokenized": 0}


def test_invalid_replies_are_counted_spend_a_turn_and_are_told_what_is_allowed():
    env = ab.environments.load("gymnasium", max_turns=3, **LAKE)
    trajectory, prompts = play(env, "jump!", "import os", "down")
    assert trajectory.rewards == {"agent": 0.0} and len(trajectory.turns) == 3
    assert trajectory.counts == {"invalid_action": 2, "actions": 1, "out_of_turns": 1,
                                 "retokenized": 0}
    assert "That is not an action. Reply with one of: left, down, right, up." in prompts[1]


def test_a_parse_and_render_of_your_own_drive_any_action_space():
    seen = []

    def render(observation, info):
        seen.append(observation)
        return f"you are on cell {observation}"

    env = Gymnasium("FrozenLake-v1", make_kwargs={"is_slippery": False}, render=render,
                    parse=lambda text: {"s": 1, "e": 2}.get(text.strip()[:1]),
                    instructions="Say s (south) or e (east).")
    trajectory, prompts = play(env, "s", "s", "e", "e", "s", "e")
    assert trajectory.rewards == {"agent": 1.0}
    assert seen == [0, 4, 8, 9, 10, 14] and "you are on cell 0" in prompts[0]


def test_train_and_test_starts_never_meet():
    env = ab.environments.load("gymnasium", **LAKE)
    train = [s["seed"] for s, _ in zip(env.samples(0), range(200), strict=False)]
    test = [s["seed"] for s, _ in zip(env.split_samples("test"), range(200), strict=False)]
    assert not set(train) & set(test) and len(set(train)) == 200
    assert train == [s["seed"] for s, _ in zip(env.samples(0), range(200), strict=False)]
    with pytest.raises(ValueError, match="has splits"):
        next(env.split_samples("validation"))


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match="cannot make 'FrozenLake-v99'.*FrozenLake"):
        Gymnasium("FrozenLake-v99")
    with pytest.raises(ValueError, match=r"Discrete\(4\): give 4 distinct names"):
        Gymnasium("FrozenLake-v1", actions=["a", "b"])
    with pytest.raises(ValueError, match="neither Discrete nor Text: pass parse="):
        Gymnasium("Pendulum-v1")
    with pytest.raises(ValueError, match="max_turns must be"):
        Gymnasium("FrozenLake-v1", max_turns=0)
    assert Gymnasium("CliffWalking-v1").actions == ACTION_NAMES["CliffWalking"]
    assert gymnasium.__version__ == "1.4.0"


@pytest.mark.slow  # a real engine and trainer
def test_a_policy_trains_on_a_gymnasium_environment(tmp_path):
    with ab.Session(tmp_path, trainer="thread") as session:
        policy = session.policy("agent", model=ab.models.tiny_chat(), max_batch_size=32,
                                # a random policy never reaches the goal: every group ties
                                algorithm=ab.GRPO(entropy_coef=0.01, filter_groups=False))
        session.wire(ab.environments.load("gymnasium", max_turns=4, **LAKE), agent=policy)
        run = session.train(steps=2, batch_size=4, group_size=4)
        run.wait(timeout=240, progress=False)
        assert run.status == "finished" and len(run.rows) == 2
        assert run.episodes[0].turns  # a recorded conversation


def test_the_readme_table_row_is_true():
    from tests.test_reasoning_gym_env import readme_row

    row = readme_row("Gymnasium")
    env = ab.environments.load("gymnasium", **LAKE)
    trajectory, prompts = play(env, "down", "right", "left")  # (1,0), (1,1): the hole
    assert row["multi-turn"].startswith("yes") and len(trajectory.turns) == 2
    assert row["tools"] == "no" and "<tools>" not in prompts[0]
    assert row["multi-agent"].startswith("no") and env.roles == ("agent",)
    assert row["streaming"].startswith("no")
    assert row["partial rewards"].startswith("yes")
    # the step rewards, summed: CliffWalking's -1 a step, -100 for the cliff (back to the start)
    cliff = ab.environments.load("gymnasium", id="CliffWalking-v1", max_turns=2)
    walked, _ = play(cliff, "up", "down")
    assert walked.rewards == {"agent": -2.0}
    fallen, _ = play(cliff, "right", "up")
    assert fallen.rewards == {"agent": -101.0} and fallen.counts["out_of_turns"] == 1
