"""The simulated episodes: solver + verifier (AstraFlow's actor_and_verify, without the retry),
and the solver alone.

The solver answers the problem (a long-tail length, drawn by its engine); the verifier reads the
problem and the answer and gives a shorter verdict. Outcomes are coin flips seeded by (run seed,
sample, episode): each problem has a difficulty, so a group's solver rewards differ and carry
signal. Solver reward: 1 if correct. Verifier reward: 1 if its verdict matches the truth.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from ..environments.base import Environment, EpisodeContext
from .costs import Workload

__all__ = ["SolverVerifier", "Solver"]

_PROMPT_ID, _INSTRUCTION_ID = 2, 3


class _Problems(Environment):
    """Problems of random difficulty, and a seeded outcome stream per episode (what both
    simulated environments share). Subclasses set `seed` and `_episodes`."""

    seed: int
    _episodes: Counter[int]

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        rng = random.Random(f"samples:{seed}")
        for i in itertools.count():
            yield {"id": i, "difficulty": rng.random()}

    def _outcomes(self, sample: Mapping[str, Any]) -> random.Random:
        """The random outcomes of the next episode of `sample`: seeded by run seed, sample and
        the episode's number among that sample's (episodes of a sample are exchangeable, so
        the order they finish in does not matter)."""
        k = self._episodes[sample["id"]]
        self._episodes[sample["id"]] += 1
        return random.Random(f"episode:{self.seed}:{sample['id']}:{k}")


class SolverVerifier(_Problems):
    """Two roles, two generations per episode, random (seeded) rewards.

    Args:
        workload: prompt and generation lengths, verifier accuracy, token scale.
        seed: seed of the outcomes.
    """

    roles = ("solver", "verifier")

    def __init__(self, workload: Workload, seed: int = 0):
        self.workload, self.seed = workload, seed
        self._episodes: Counter[int] = Counter()

    async def episode(self, ctx: EpisodeContext, sample: Mapping[str, Any]) -> dict[str, float]:
        w = self.workload
        rng = self._outcomes(sample)
        prompt = (_PROMPT_ID,) * w.sim_tokens(w.prompt_tokens)
        answer = await ctx.generate("solver", prompt, max_new_tokens=w.sim_tokens(w.solver.cap))
        verifier_prompt = (prompt + answer.completion_ids
                           + (_INSTRUCTION_ID,) * w.sim_tokens(w.verifier_prompt_extra))
        await ctx.generate("verifier", verifier_prompt, max_new_tokens=w.sim_tokens(w.verifier.cap))
        correct = rng.random() >= sample["difficulty"]
        verdict_right = rng.random() < w.verifier_accuracy
        return {"solver": float(correct), "verifier": float(verdict_right)}


class Solver(_Problems):
    """One role: the solver answers (a long-tail length drawn by its engine); reward 1 if
    correct, a coin flip weighted by the problem's difficulty (seeded by run seed, sample and
    episode). The single-policy episode of the cross-region simulations.

    Args:
        workload: prompt and answer lengths, token scale.
        seed: seed of the outcomes.
        cap: most real tokens an answer may have (default: the workload's solver cap; a
            `LengthSchedule` passes its own).
    """

    roles = ("solver",)

    def __init__(self, workload: Workload, seed: int = 0, cap: int | None = None):
        self.workload, self.seed = workload, seed
        self.cap = workload.solver.cap if cap is None else cap
        self._episodes: Counter[int] = Counter()

    async def episode(self, ctx: EpisodeContext, sample: Mapping[str, Any]) -> dict[str, float]:
        w = self.workload
        rng = self._outcomes(sample)
        prompt = (_PROMPT_ID,) * w.sim_tokens(w.prompt_tokens)
        await ctx.generate("solver", prompt, max_new_tokens=w.sim_tokens(self.cap))
        return {"solver": float(rng.random() >= sample["difficulty"])}
