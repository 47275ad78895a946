"""Single-digit arithmetic: "3+4=" -> "7".

Problems are additions and subtractions of digits whose result is itself a digit (0-9), so the
answer is one token of the tiny model's character tokenizer. The reward is 1 when the completion
starts with exactly the answer's digits (followed by end of text or a non-digit), else 0. An
untrained model samples almost uniformly from ~60 characters, so its reward is about 0.02; a
policy that guesses a random digit would get about 0.1. Learning it needs the answer to depend on
both operands and the operator: real arithmetic, small enough to learn on a CPU in minutes.

The answer is scored through a tool call (`ctx.tool("check", check, ...)`), so the episode
debugger shows the check between the turn and the reward, and re-scores an edited answer with it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

from astranb import Environment, SamplingParams

__all__ = ["Arithmetic", "check", "leading_integer"]


class Arithmetic(Environment):
    """Digit arithmetic with a 0/1 correctness reward.

    Args:
        ops: operators to draw from, any of "+" and "-".
        max_value: largest operand and result (at most 9 keeps every answer one token).
        max_new_tokens: completion budget; the answer plus a stop needs 2.
    """

    roles = ("solver",)

    def __init__(self, ops: str = "+-", max_value: int = 9, max_new_tokens: int = 2):
        if not ops or set(ops) - {"+", "-"}:
            raise ValueError(f"ops must be made of '+' and '-', got {ops!r}")
        if not 1 <= max_value <= 99:
            raise ValueError(f"max_value must be in 1..99, got {max_value}")
        self.ops = ops
        self.max_value = max_value
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens)

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        rng = random.Random(seed)
        while True:
            yield self.problem(rng)

    def problem(self, rng: random.Random) -> dict[str, Any]:
        """One random problem whose result lies in 0..max_value."""
        while True:
            a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
            op = rng.choice(self.ops)
            answer = a + b if op == "+" else a - b
            if 0 <= answer <= self.max_value:
                return {"prompt": f"{a}{op}{b}=", "answer": answer}

    async def episode(self, ctx, sample: Mapping[str, Any]) -> float:
        out = await ctx.generate("solver", sample["prompt"])
        return 1.0 if await ctx.tool("check", check, out.text, sample["answer"]) else 0.0


def check(completion: str, answer: int) -> bool:
    """Whether `completion` starts with exactly `answer`'s digits (see `leading_integer`)."""
    return leading_integer(completion) == answer


def leading_integer(text: str) -> int | None:
    """The integer formed by the digits at the start of `text`, or None if it starts otherwise."""
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None
