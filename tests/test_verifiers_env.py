"""The verifiers adapter against the real verifiers 0.4.0: tasksets defined here over in-test
datasets (datasets.Dataset.from_list), played by scripted replies through each episode's
OpenAI-compatible endpoint. A single-turn task scored by two rewards and a metric (each value
kept in the episode), a multi-turn env that answers the agent turn by turn, a task whose tool
server the scripted reply calls, hostile replies, clear errors, and a short training run.
verifiers' chat loop runs as a subprocess of this Python (astranb_verifiers.LocalChat): no uv,
no network."""

from __future__ import annotations

import json
import sys
import types

import anyio
import pytest
import verifiers
import verifiers.v1 as vf
from astranb_verifiers import HARNESS_ID, LocalChat, Verifiers
from datasets import Dataset

import astranb as ab
from tests.test_math_env import TOKENIZER, scripted

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
