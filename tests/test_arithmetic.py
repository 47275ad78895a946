"""The arithmetic environment: problems, reward, discovery by name."""

import random

import pytest
from astranb_arithmetic import Arithmetic, leading_integer

import astranb as ab


def test_loads_by_name():
    env = ab.environments.load("arithmetic", ops="+")
    assert isinstance(env, Arithmetic) and env.ops == "+"
    assert "arithmetic" in ab.environments.available()


def test_problems_have_single_digit_answers_that_are_correct():
    env = Arithmetic()
    for sample, _ in zip(env.samples(seed=1), range(200), strict=False):
        a, op, b = sample["prompt"][0], sample["prompt"][1], sample["prompt"][2]
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert sample["answer"] == expected and 0 <= expected <= 9
        assert sample["prompt"].endswith("=")


def test_same_seed_same_problems():
    a = [s["prompt"] for s, _ in zip(Arithmetic().samples(3), range(20), strict=False)]
    b = [s["prompt"] for s, _ in zip(Arithmetic().samples(3), range(20), strict=False)]
    assert a == b


def test_leading_integer():
    assert leading_integer("7") == 7
    assert leading_integer("7x") == 7
    assert leading_integer("73") == 73  # "73" is not "7"
    assert leading_integer("x7") is None
    assert leading_integer("") is None


def test_reward(tmp_path):
    class Ctx:
        def __init__(self, text):
            self.text = text

        async def generate(self, role, prompt):
            assert role == "solver" and prompt == "3+4="
            return type("G", (), {"text": self.text})()

        async def tool(self, name, fn, *args):
            assert name == "check"
            return fn(*args)

    import anyio

    env = Arithmetic()
    sample = {"prompt": "3+4=", "answer": 7}
    assert anyio.run(env.episode, Ctx("7"), sample) == 1.0
    assert anyio.run(env.episode, Ctx("7!"), sample) == 1.0
    assert anyio.run(env.episode, Ctx("71"), sample) == 0.0
    assert anyio.run(env.episode, Ctx("8"), sample) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="ops must be"):
        Arithmetic(ops="*")
    random.seed(0)
