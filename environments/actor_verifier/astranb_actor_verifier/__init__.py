"""Solver and verifier: one answers a small sum, the other judges the answer, a rejected answer
gets one retry. Two roles, meant for two policies that each learn their own job.

    solver    "3+4="                 -> "5"
    verifier  "3+4=5?"               -> "n big"   first character 'y' approves, 'n' rejects; the
                                                  rest is a short reason the solver gets to read
    solver    "3+4=5?n big\\n3+4="    -> "7"       only after a reject (or a reply that is neither)

Rewards, one per role (a policy trains on its own turns with its own role's reward), with each
answer judged by the arithmetic environment's `check` tool (`ctx.tool`, so the debugger shows it)
and combined by `episode_rewards` (rewards.py explains the rule):

    solver   = 1 if its first answer is right (and a retry does not give it up), retry_discount
               (0.5) if it is wrong, rejected and right on the retry, else 0
    verifier = half its judgement of the first answer (1 for 'y' to a right one or 'n' to a
               wrong one, else 0; a reply starting with anything else is a reject worth 0), half
               the solver's reward

An earlier rule (solver: its final answer; verifier: its verdict only) settled into "the verifier
rejects everything and the solver answers right on the retry": the solver's first answer did not
matter and the verifier only learnt the base rate. Under this rule that pair earns 0.5 and 0.75,
against 1 and 1 for a solver right at once and a verifier that approves it, and a solver gains by
answering right at once whatever the verifier does.

Problems come from the arithmetic environment (`astranb_arithmetic.Arithmetic.problem`): by
default single-digit additions with a single-digit sum, 55 problems, so that a tiny model learns
the solver's job in a few hundred steps on a CPU. An untrained verifier says 'y' or 'n' by chance
(2 of ~60 characters); judging each answer needs the sum itself.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

from astranb_arithmetic import Arithmetic, check

from astranb import Environment, SamplingParams

from .report import early_late, role_rewards
from .rewards import episode_rewards

__all__ = ["ActorVerifier", "verdict", "verifier_prompt", "retry_prompt", "episode_rewards",
           "role_rewards", "early_late"]


class ActorVerifier(Environment):
    """A solver answers, a verifier approves or rejects, a rejected solver retries once.

    Args:
        ops: operators of the problems, any of "+" and "-" (see `Arithmetic`).
        max_value: largest operand and result (9 keeps every answer one character).
        reason_tokens: characters the verifier may add after its verdict (0: the verdict only).
        retry: give the solver a second try after a reject (False: its first answer is final).
        retry_discount: the solver's reward for a wrong first answer fixed on the retry.
        team_weight: the share of the verifier's reward that is the solver's reward.
    """

    roles = ("solver", "verifier")

    def __init__(self, ops: str = "+", max_value: int = 9, reason_tokens: int = 3,
                 retry: bool = True, retry_discount: float = 0.5, team_weight: float = 0.5):
        if not isinstance(reason_tokens, int) or reason_tokens < 0:
            raise ValueError(f"reason_tokens must be an integer >= 0, got {reason_tokens!r}")
        for name, value in (("retry_discount", retry_discount), ("team_weight", team_weight)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.problems = Arithmetic(ops=ops, max_value=max_value)
        self.reason_tokens = reason_tokens
        self.retry = retry
        self.retry_discount = retry_discount
        self.team_weight = team_weight
        # the solver's answer is one digit, then end of text: two tokens
        self.sampling = SamplingParams(max_new_tokens=2)

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        rng = random.Random(seed)
        while True:
            yield self.problems.problem(rng)

    async def episode(self, ctx, sample: Mapping[str, Any]) -> dict[str, float]:
        problem, answer = sample["prompt"], sample["answer"]
        first = (await ctx.generate("solver", problem)).text
        reply = (await ctx.generate("verifier", verifier_prompt(problem, first),
                                    max_new_tokens=1 + self.reason_tokens)).text
        said = verdict(reply)
        first_right = await ctx.tool("check", check, first, answer)
        retry_right = None
        if said != "y" and self.retry:
            final = (await ctx.generate("solver", retry_prompt(problem, first, reply))).text
            retry_right = await ctx.tool("check", check, final, answer)
        solver, verifier = episode_rewards(first_right, said, retry_right,
                                           retry_discount=self.retry_discount,
                                           team_weight=self.team_weight)
        return {"solver": solver, "verifier": verifier}


def verdict(reply: str) -> str | None:
    """'y' (approve) or 'n' (reject) from the reply's first character; None for anything else."""
    return reply[0] if reply[:1] in ("y", "n") else None


def verifier_prompt(problem: str, answer: str) -> str:
    """What the verifier sees: the problem, the solver's answer, a question mark ("3+4=5?")."""
    return f"{problem}{answer}?"


def retry_prompt(problem: str, answer: str, reply: str) -> str:
    """What a rejected solver sees: its try, the verifier's reply, the problem again."""
    return f"{verifier_prompt(problem, answer)}{reply}\n{problem}"
