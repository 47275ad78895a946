"""Dynamic sampling with a bound, and noticing a task that has been learned.

Group-relative advantages are zero for a *tied* group (every episode earned the same reward), so
with `filter_groups` (GRPO's default) such a group is dropped and the rollouts play on until a
batch of groups with a signal is full: dynamic sampling, as in DAPO. While few groups tie this
costs little. Once a policy has learned its task nearly every group ties (all correct), and
filling one batch takes ever more episodes: unbounded, a run that learned its task crawls
(thousands of groups played for one step).

The bound, `session.train(max_gen_batches=k)` (verl calls its version `max_num_gen_batches`):
after `(k - 1) x groups_per_batch` groups of a policy were dropped by the filter since its last
step, its next tied groups go into its buffer as they come, so a step costs at most about k
batches of rollouts:

    groups played for one step  <=  k x groups_per_batch  (+ the groups already in flight)

Such a step trains on what it has: the groups of its batch that have a signal (`in_batch`).
The tied groups that filled the batch are left out of it and accounted as filtered, because
they would add no policy-gradient term (their advantages are 0) but would still add their
tokens' entropy bonus and count in the token mean, diluting the signal of the others: measured
on the quickstart, training them cut its reward over the last 10% of steps from 0.70 to 0.42.
Only a batch in which no group has a signal trains its tied groups (an entropy-bonus-only step:
there is nothing else to train). The step's row says so: `filter_budget_hit`, `tied_trained`
(tied groups trained), and the filtered count of its `samples_dropped`.

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

Fewer ties in the first place: with `train(sampler="pass_rate")` the orchestrator skips, most
of the time, samples whose recent groups were solved (`PassRates`), so where samples repeat the
rollouts go to the ones with something left to learn. A skipped sample is accounted as dropped
("solved"); no episode of it is played.

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
           "learned_message", "SAMPLERS", "PassRates"]

DEFAULT_MAX_GEN_BATCHES = 2
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

SAMPLERS = ("stream", "pass_rate")
"""`train(sampler=...)`: "stream" plays every sample in stream order; "pass_rate" skips samples
it has seen solved, most of the time (`PassRates`)."""


class PassRates:
    """Which samples are solved, from the groups played on them; solved ones are skipped.

    A sample is known by the hash of its JSON text (a sample that is not plain JSON is never
    skipped). After each group on it, its pass rate moves halfway towards the group's share
    of episodes at the policy's best reward (an average that forgets: the policy changes).
    A sample is then played with probability max(floor, 1 - pass rate): one never solved
    always, one solved every time in `floor` of its draws, so none is starved and a sample
    that is forgotten again is seen. Where the stream's samples repeat (a generator over a
    small space, epochs of a dataset), the groups played are the ones with something left to
    learn; where they do not repeat, nothing is ever skipped.

    Args:
        floor: the smallest probability of playing a sample (0 < floor <= 1).
        seed: seed of the skip decisions.
        memory: samples remembered at most (the least recently updated are forgotten).
    """

    def __init__(self, floor: float = 0.1, seed: int = 0, memory: int = 100_000):
        if not 0 < floor <= 1:
            raise ValueError(f"the pass-rate sampler's floor must be in (0, 1], got {floor!r}")
        self.floor, self.memory = floor, memory
        self._rates: dict[str, float] = {}
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._rates)

    @staticmethod
    def key(sample: Mapping[str, Any]) -> str | None:
        """The sample's identity (a hash of its JSON text), or None when it is not JSON."""
        try:
            text = json.dumps(dict(sample), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
        return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))

    def rate(self, key: str | None) -> float:
        """The sample's pass rate (0 for one never played)."""
        return self._rates.get(key, 0.0) if key is not None else 0.0

    def record(self, key: str | None, share: float) -> None:
        """A group on sample `key` had `share` of its episodes at the best reward."""
        if key is None:
            return
        old = self._rates.pop(key, share)  # re-inserted last: the dict's order is recency
        self._rates[key] = (old + share) / 2
        if len(self._rates) > self.memory:
            del self._rates[next(iter(self._rates))]

    def play(self, key: str | None) -> bool:
        """Whether to play the sample now."""
        return self._rng.random() < max(self.floor, 1.0 - self.rate(key))
