"""Dynamic sampling with a bound, and noticing a task that has been learned.

Group-relative advantages are zero for a *tied* group (every episode earned the same reward), so
with `filter_groups` (GRPO's default) such a group is dropped and the rollouts play on until a
batch of groups with a signal is full: dynamic sampling, as in DAPO. While few groups tie this
costs little. Once a policy has learned its task nearly every group ties (all correct), and
filling one batch takes ever more episodes: unbounded, a run that learned its task crawls
(thousands of groups played for one step).

The bound, `session.train(max_gen_batches=k)` (verl calls its version `max_num_gen_batches`):
once `(k - 1) x groups_per_batch` groups of a policy were dropped by the filter since its last
step, its buffer is *cut* (`Buffer.cut`): the waiting step takes the groups there are instead of
waiting for a full batch (and if there are none, the next tied group goes in, so it has one).
A step therefore waits for at most about k batches of rollouts:

    groups played for one step  <=  k x groups_per_batch  (+ what plays while it trains)

Such a step trains on what it has: the groups of its batch that have a signal (`in_batch`). A
tied group in a batch (the one let in to end a wait, or left over from an earlier one) is left
out of it and accounted as filtered when others have a signal, because it would add no
policy-gradient term (its advantages are 0) but would still add its tokens' entropy bonus and
count in the token mean, diluting the signal of the others: measured on the quickstart,
training such groups cut its reward over the last 10% of steps from 0.70 to 0.42. Only a batch
in which no group has a signal trains its tied groups (an entropy-bonus-only step: there is
nothing else to train). The step's row says so: `filter_budget_hit`, `tied_trained` (tied
groups trained), `samples_trained` (fewer than a batch's groups) and the filtered count of its
`samples_dropped`.

The bound holds from a policy's first group with a signal on. Before it, every group tying is
the cold start of an untrained policy (every reward 0 until one episode gets lucky): training
those groups would teach only the entropy bonus, so they are dropped without a bound and the
watchdog's "nothing to learn" stall (`stall.filtered_message`) still says what to do.

*Learned* is an event, not a crawl: once the last `learned_streak(groups_per_batch)` groups of a
policy all tied, some of them at the best reward it has ever earned (and it earned less
before), the run records a "learned" event with `learned_message`: every group at the best
reward is a task learned at this difficulty; some at the best and others lower (on the
largest-digit task the tiny model ends solving 93% of the prompts always and the rest never)
is a task learned as far as its groups can teach, since no group carries a signal any more.
`train(stop_when_learned=True)` ends the policy's training there. The share of tied groups per
step is every row's `tied_fraction`.

Fewer ties in the first place: with `train(sampler="open")` the orchestrator skips, most of
the time, samples its policies have lately solved (`OpenSamples`), so where samples repeat the
rollouts go to the ones with something left to learn. A skipped sample costs no episode; it is
accounted as filtered and counts towards the budget (it is a tie foreseen), which is what keeps
a learned task's steps cheap: nearly every draw is a skip. Not the default (see `SAMPLERS`).

The parts here are pure (plain numbers in, plain answers out); the orchestrator feeds them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

__all__ = ["DEFAULT_MAX_GEN_BATCHES", "filter_budget", "in_batch", "learned_streak", "Ties",
           "learned_message", "SAMPLERS", "OpenSamples"]

DEFAULT_MAX_GEN_BATCHES = 4
"""Batches' worth of groups played for one step at most, by default (see the module doc)."""


def filter_budget(max_gen_batches: int | None, groups_per_batch: int) -> int | None:
    """Groups a policy may drop by `filter_groups` between two of its steps before its tied
    groups are trained; None: no bound."""
    if max_gen_batches is None:
        return None
    return (max_gen_batches - 1) * groups_per_batch


def in_batch(signals: Sequence[bool], filters: bool) -> list[bool]:
    """Which of a popped batch's groups are trained, given whether each has a signal: all of
    them for an algorithm that does not filter or when none has one, else those with one."""
    if not filters or not any(signals):
        return [True] * len(signals)
    return list(signals)


def learned_streak(groups_per_batch: int) -> int:
    """Groups in a row tied at the best reward before a policy's task counts as learned: four
    batches' worth, and at least 64 (at 0.9 per episode, a group of 8 is all correct 43% of
    the time; 64 such groups in a row happen once in 10^23)."""
    return max(64, 4 * groups_per_batch)


@dataclass
class Ties:
    """One policy's tied groups as its groups come: the streak, the best reward, the signal."""

    streak: int = 0
    """Groups in a row whose rewards tied (0 once a group has a signal)."""
    values: dict[float, int] = field(default_factory=dict)
    """The rewards the streak's groups tied at, with how many tied at each."""
    best: float = -math.inf
    """The best reward an episode of the policy has earned."""
    worst: float = math.inf
    """The worst."""
    signal: bool = False
    """Whether a group with a signal (rewards not all equal) has come."""
    said: bool = False
    """Whether the "learned" event was recorded (once per run: a learned task's groups still
    get a signal now and then, which would end a streak and say it again and again)."""

    def add(self, rewards: Sequence[float]) -> bool:
        """Count one group with these rewards (the policy's own, one per scored episode);
        returns whether it tied. A group of fewer than two scored episodes counts for
        nothing (it is dropped as failed)."""
        if len(rewards) < 2:
            return False
        self.best, self.worst = max(self.best, *rewards), min(self.worst, *rewards)
        if any(r != rewards[0] for r in rewards):
            self.signal = True
            self.streak, self.values = 0, {}
            return False
        self.streak += 1
        value = float(rewards[0])
        self.values[value] = self.values.get(value, 0) + 1
        return True

    def learned(self, streak: int) -> dict[float, int] | None:
        """Once, when the last `streak` (or more) groups all tied, some at the best
        reward, and the policy earned less at some point: the rewards they tied at, with how
        many at each, best first; else None."""
        if (self.said or self.streak < streak or self.best not in self.values
                or not self.worst < self.best):
            return None
        self.said = True
        return dict(sorted(self.values.items(), reverse=True))


def learned_message(policy: str, groups: int, tied_at: dict[float, int]) -> str:
    """What the "learned" event says; `tied_at`: reward -> groups tied at it, best first."""
    best = max(tied_at)
    if len(tied_at) == 1:
        said = (f"{policy}: the last {groups} groups all scored {best:g}: the task is learned "
                "at this difficulty")
    else:
        others = ", ".join(f"{n} at {value:g}" for value, n in tied_at.items() if value != best)
        said = (f"{policy}: the last {groups} groups all tied, {tied_at[best]} at its best "
                f"reward {best:g} and {others}: the task is learned as far as its samples can "
                "teach it (the policy solves some always and the others never)")
    return (f"{said}. No group carries a signal, so steps from here teach little. Stop here "
            "(run.stop(), or train(..., stop_when_learned=True) next time), or make the task "
            "harder.")


# -- drawing the open samples more often ----------------------------------------------------------

SAMPLERS = ("stream", "open")
"""`train(sampler=...)`: "stream" (the default) plays every sample in stream order; "open"
skips, most of the time, samples its policies have lately solved (`OpenSamples`). Measured
side by side (bench/learned.py, 3 seeds), "open" played 20% fewer episodes on the largest-digit
task but ended 0.01-0.1 lower on held-out evaluation there and 0.07 lower on the quickstart's,
so it is offered, not the default."""


@dataclass
class _Seen:
    solved: float
    """How often the sample's groups were solved lately (an average that halves the past)."""
    rewards: dict[str, float]
    """Per policy, its mean reward on the sample, lately (the same average)."""


class OpenSamples:
    """Which samples are solved, from the groups played on them; solved ones are skipped most
    of the time, so the rollouts go to the open ones.

    A group is *solved* when every episode of it earned its policy's best reward and that
    policy has earned less before (a group of an untrained policy that all score 0 is not: that
    is a cold start, and skipping it would starve the policy of the samples it must learn
    from). A sample is known by the hash of its JSON text (one that is not plain JSON is never
    skipped); after each group on it, its solved rate moves halfway towards 1 if the group was
    solved and towards 0 if not (the policy changes, so the past fades), and so does each
    policy's mean reward on it. A sample is played with probability max(floor, 1 - solved
    rate): an unknown or open one always, a solved one in `floor` of its draws, so none is
    starved and one that is forgotten is seen again. Where the stream's samples repeat (a
    generator over a small space, epochs of a dataset) the rollouts go to the open ones; where
    they do not, nothing is skipped.

    A skipped sample is accounted as dropped by the filter (it was not played because its
    groups tie). The rows' `reward` counts it at its policy's recent mean reward on it, so the
    reward still estimates the whole stream's, not only the harder samples played.

    Args:
        floor: the smallest probability of playing a sample (0 < floor <= 1).
        seed: seed of the skip decisions.
        memory: samples remembered at most (the least recently updated are forgotten).
    """

    def __init__(self, floor: float = 0.1, seed: int = 0, memory: int = 100_000):
        if not 0 < floor <= 1:
            raise ValueError(f"the open-samples sampler's floor must be in (0, 1], got {floor!r}")
        self.floor, self.memory = floor, memory
        self._seen: dict[str, _Seen] = {}
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._seen)

    @staticmethod
    def key(sample: Mapping[str, Any]) -> str | None:
        """The sample's identity (a hash of its JSON text), or None when it is not JSON."""
        try:
            text = json.dumps(dict(sample), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
        return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))

    def solved_rate(self, key: str | None) -> float:
        """How often the sample's groups were solved lately (0 for one never played)."""
        seen = self._seen.get(key) if key is not None else None
        return 0.0 if seen is None else seen.solved

    def reward(self, key: str | None, policy: str) -> float | None:
        """`policy`'s recent mean reward on the sample (None: not known)."""
        seen = self._seen.get(key) if key is not None else None
        return None if seen is None else seen.rewards.get(policy)

    def record(self, key: str | None, solved: bool, rewards: Mapping[str, float]) -> None:
        """A group on sample `key` was played: whether it was solved, and each policy's mean
        reward."""
        if key is None:
            return
        seen = self._seen.pop(key, None)  # re-inserted last: the dict's order is recency
        if seen is None:
            seen = _Seen(float(solved), dict(rewards))
        else:
            seen.solved = (seen.solved + float(solved)) / 2
            for policy, value in rewards.items():
                old = seen.rewards.get(policy, value)
                seen.rewards[policy] = (old + value) / 2
        self._seen[key] = seen
        if len(self._seen) > self.memory:
            del self._seen[next(iter(self._seen))]

    def play(self, key: str | None) -> bool:
        """Whether to play the sample now."""
        return self._rng.random() < max(self.floor, 1.0 - self.solved_rate(key))
