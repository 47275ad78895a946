"""The simulator's cost model: what GPUs cost per token, and how long generations are.

Everything here is plain data plus the arithmetic the ideal-overlap bound needs. Times are in
seconds, token counts in real tokens. A simulated token stands for `Workload.token_scale` real
tokens (a coarse token keeps a GPU-scale run cheap in Python); every cost is charged per real
token, so the scale changes only the granularity at which requests join and leave a batch.

Rollout GPU. One decode step over `active` sequences takes `step_base + step_per_seq * active`
seconds (the weights are read once per step; each sequence adds its KV-cache reads), so a full
batch of `max_batch` decodes at the best cost per token, `(step_base + step_per_seq * max_batch)
/ max_batch`. Prompts are prefilled at `prefill_per_token` seconds per token in the step a
request joins. A weight update pauses the policy's sequences for `update_seconds`, after which
each in-flight sequence is re-prefilled (prompt and tokens so far) under the new weights.

Training GPU. A step on `gpus` GPUs over `tokens` tokens (prompt + completion of every row,
unpadded: packed sequences) takes `step_overhead + tokens * gpu_seconds_per_token / gpus`.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

__all__ = ["Lengths", "LengthSchedule", "RolloutCosts", "TrainCosts", "Workload",
           "ideal_episode_seconds"]


@dataclass(frozen=True)
class Lengths:
    """Generation lengths: lognormal around `median`, capped at `cap` (sigma=0: always the
    median, for hand-checkable runs)."""

    median: int
    """Median length in real tokens."""
    sigma: float = 1.0
    """Lognormal shape; 1.0 gives a long tail (the mean is e^(sigma^2/2) times the median)."""
    cap: int = 8192
    """max_new_tokens: longer draws stop here (finish_reason "length")."""

    def __post_init__(self) -> None:
        if not 1 <= self.median <= self.cap:
            raise ValueError(f"need 1 <= median <= cap, got median={self.median}, cap={self.cap}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def draw(self, rng: random.Random) -> int:
        """One length in real tokens, in [1, cap]."""
        if self.sigma == 0:
            return self.median
        return max(1, min(self.cap, round(rng.lognormvariate(math.log(self.median), self.sigma))))


@dataclass(frozen=True)
class LengthSchedule:
    """Generation lengths that change as training goes on (demand that varies over a run).

    RL on reasoning tasks typically lengthens answers as the policy learns to think longer, and
    a curriculum can switch between short and long problems; either way the rollout work per
    step changes while the training work changes less (prompts stay the same). The schedule is
    piecewise linear in the weights version: `points` are (version, Lengths) in increasing
    version order; between two points the median and sigma move linearly, before the first and
    after the last they stay. Two points one version apart make a phase change.
    """

    points: tuple[tuple[int, Lengths], ...]
    """(version, lengths from then on) pairs, versions increasing."""

    def __post_init__(self) -> None:
        versions = [v for v, _ in self.points]
        if not versions or versions != sorted(set(versions)) or versions[0] < 0:
            raise ValueError(f"points need distinct versions >= 0 in increasing order, got "
                             f"{versions}; e.g. ((0, Lengths(400)), (8, Lengths(2400)))")

    @classmethod
    def growing(cls, start: Lengths, end: Lengths, over: int) -> LengthSchedule:
        """From `start` at version 0 to `end` at version `over`, linearly."""
        return cls(((0, start), (max(1, over), end)))

    @classmethod
    def phases(cls, *phases: tuple[int, Lengths]) -> LengthSchedule:
        """Constant lengths per phase: (first version, lengths) pairs."""
        points: list[tuple[int, Lengths]] = []
        for i, (version, lengths) in enumerate(phases):
            if i:  # hold the previous phase until the version before this one
                points.append((version - 1, phases[i - 1][1]))
            points.append((version, lengths))
        return cls(tuple(points))

    @property
    def cap(self) -> int:
        return max(lengths.cap for _, lengths in self.points)

    def at(self, version: int) -> Lengths:
        """The lengths drawn by weights of `version`."""
        return _lengths_at(self, version)


@functools.lru_cache(maxsize=4096)
def _lengths_at(schedule: LengthSchedule, version: int) -> Lengths:
    points = schedule.points
    if version <= points[0][0]:
        first = points[0][1]
        return Lengths(first.median, first.sigma, schedule.cap)
    for (v0, a), (v1, b) in zip(points, points[1:], strict=False):
        if version <= v1:
            f = (version - v0) / (v1 - v0)
            return Lengths(round(a.median + f * (b.median - a.median)),
                           a.sigma + f * (b.sigma - a.sigma), schedule.cap)
    last = points[-1][1]
    return Lengths(last.median, last.sigma, schedule.cap)


@dataclass(frozen=True)
class RolloutCosts:
    """The rollout GPU pool, shared by every policy's engine."""

    gpus: int = 8
    """Rollout GPUs (one engine replica per GPU, serving every policy)."""
    max_batch: int = 128
    """Most sequences one GPU decodes at once; later requests queue on it."""
    step_base: float = 0.015
    """Seconds of a decode step that do not depend on the batch (reading the weights)."""
    step_per_seq: float = 0.0002
    """Seconds each sequence in the batch adds to a decode step."""
    prefill_per_token: float = 2e-5
    """Seconds per prompt token prefilled (also for re-prefills after a weight update)."""
    update_seconds: float = 2.0
    """Seconds a policy's sequences pause while new weights are loaded."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.max_batch < 1:
            raise ValueError(f"need gpus >= 1 and max_batch >= 1, got gpus={self.gpus}, "
                             f"max_batch={self.max_batch}")

    def step_seconds(self, active: int) -> float:
        """One decode step over `active` sequences."""
        return self.step_base + self.step_per_seq * active

    def ideal_gpu_seconds(self, decode_tokens: float, prefill_tokens: float) -> float:
        """GPU-seconds of the work at full batches: the least any schedule can spend on it."""
        per_token = self.step_seconds(self.max_batch) / self.max_batch
        return decode_tokens * per_token + prefill_tokens * self.prefill_per_token


@dataclass(frozen=True)
class TrainCosts:
    """The training GPU pool (separate from the rollout GPUs)."""

    gpus: int = 8
    """Training GPUs in all."""
    gpu_seconds_per_token: float = 1.6e-4
    """GPU-seconds of forward + backward (+ logprob recompute) per trained token."""
    step_overhead: float = 2.0
    """Seconds per step that do not shrink with more GPUs (optimizer step, gathers)."""
    placement: str = "shared"
    """Where astranb's schedules train: "shared" puts every policy on all the GPUs, taking turns
    (one astranb trainer service for all policies, `Session(trainer=url)`); "split" gives each
    policy its own GPUs (AstraFlow: one torchrun trainer per model). The baselines always train
    one policy at a time on all the GPUs."""
    split: tuple[int, ...] | None = None
    """GPUs of each policy's trainer with placement="split", in policy order; None: even."""

    def __post_init__(self) -> None:
        if self.placement not in ("split", "shared"):
            raise ValueError(f"placement must be 'split' or 'shared', got {self.placement!r}")
        if self.split is not None and sum(self.split) != self.gpus:
            raise ValueError(f"split {self.split} must add up to gpus={self.gpus}")

    def step_seconds(self, tokens: int, gpus: int) -> float:
        """One train step over `tokens` tokens on `gpus` GPUs."""
        return self.step_overhead + tokens * self.gpu_seconds_per_token / gpus

    def gpus_of(self, policies: int) -> list[int]:
        """Each policy's GPUs when they train side by side."""
        if self.split is not None:
            if len(self.split) != policies:
                raise ValueError(f"split {self.split} names {len(self.split)} trainers, "
                                 f"the run has {policies} policies")
            return list(self.split)
        if self.gpus < policies:
            raise ValueError(f"{self.gpus} training GPUs cannot give each of {policies} "
                             "policies its own; add GPUs")
        base, extra = divmod(self.gpus, policies)
        return [base + (i < extra) for i in range(policies)]


@dataclass(frozen=True)
class Workload:
    """The solver + verifier episode (AstraFlow's actor_and_verify, without the retry)."""

    prompt_tokens: int = 512
    """Tokens of a problem statement."""
    solver: Lengths = Lengths(1500, 0.9, 8192)
    """Solver answer lengths (the long tail)."""
    verifier: Lengths = Lengths(256, 0.6, 1024)
    """Verifier judgement lengths."""
    verifier_prompt_extra: int = 64
    """Instruction tokens the verifier reads besides the problem and the solver's answer."""
    verifier_accuracy: float = 0.8
    """Probability that the verifier's verdict matches the solver's actual correctness."""
    token_scale: int = 32
    """Real tokens per simulated token (costs stay per real token)."""

    def __post_init__(self) -> None:
        if self.token_scale < 1:
            raise ValueError(f"token_scale must be >= 1, got {self.token_scale}")
        if not 0 <= self.verifier_accuracy <= 1:
            raise ValueError(f"verifier_accuracy must be in [0, 1], got {self.verifier_accuracy}")

    def sim_tokens(self, real: int) -> int:
        """Simulated tokens for `real` real tokens (rounded up)."""
        return -(-real // self.token_scale)


def ideal_episode_seconds(workload: Workload, costs: RolloutCosts, solver: Lengths | None = None,
                          verifier: bool = True, draws: int = 20_000, seed: int = 0) -> float:
    """Expected GPU-seconds of one episode at full batches (Monte Carlo over the lengths), with
    lengths rounded to whole simulated tokens as the engine rounds them.

    Args:
        workload: prompt, lengths and token scale.
        costs: the rollout GPU's costs.
        solver: the solver's lengths (default: the workload's).
        verifier: whether the verifier plays too (it reads the problem and the answer).
        draws: Monte Carlo draws.
        seed: of the draws.
    """
    w, rng = workload, random.Random(f"work:{seed}")
    solver = w.solver if solver is None else solver
    real = lambda tokens: w.sim_tokens(tokens) * w.token_scale  # noqa: E731
    prompt, extra = real(w.prompt_tokens), real(w.verifier_prompt_extra)
    decode = prefill = 0
    for _ in range(draws):
        answer = real(solver.draw(rng))
        decode += answer
        prefill += prompt
        if verifier:
            decode += real(w.verifier.draw(rng))
            prefill += prompt + answer + extra
    return costs.ideal_gpu_seconds(decode, prefill) / draws
