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

Such a step trains on what it has. What its tied groups contribute: no policy-gradient term
(their advantages are 0), their tokens' entropy bonus (`entropy_coef`), and their tokens in the
token mean, which dilutes the gradient of the groups with a signal exactly as
`filter_groups=False` does. The step's row says so: `filter_budget_hit`, `tied_trained`.

The bound holds from a policy's first group with a signal on. Before it, every group tying is
the cold start of an untrained policy (every reward 0 until one episode gets lucky): training
those groups would teach only the entropy bonus, so they are dropped without a bound and the
watchdog's "nothing to learn" stall (`stall.filtered_message`) still says what to do.

*Learned* is an event, not a crawl: once the last `learned_streak(groups_per_batch)` groups of a
policy all tied at the best reward it has ever earned (and it earned less before), the run
records a "learned" event with `learned_message`; `train(stop_when_learned=True)` ends the
policy's training there. The share of tied groups per step is every row's `tied_fraction`.

The parts here are pure (plain numbers in, plain answers out); the orchestrator feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_GEN_BATCHES", "filter_budget", "learned_streak", "Ties",
           "learned_message"]

DEFAULT_MAX_GEN_BATCHES = 3
"""Batches' worth of groups played for one step at most, by default (see the module doc)."""


def filter_budget(max_gen_batches: int | None, groups_per_batch: int) -> int | None:
    """Groups a policy may drop by `filter_groups` between two of its steps before its tied
    groups are trained; None: no bound."""
    if max_gen_batches is None:
        return None
    return (max_gen_batches - 1) * groups_per_batch


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
    values: frozenset[float] = frozenset()
    """The rewards the streak's groups tied at."""
    best: float = -math.inf
    """The best reward an episode of the policy has earned."""
    worst: float = math.inf
    """The worst."""
    signal: bool = False
    """Whether a group with a signal (rewards not all equal) has come."""
    said: bool = False
    """Whether the current streak's "learned" event was recorded."""

    def add(self, rewards: Sequence[float]) -> bool:
        """Count one group with these rewards (the policy's own, one per scored episode);
        returns whether it tied. A group of fewer than two scored episodes counts for
        nothing (it is dropped as failed)."""
        if len(rewards) < 2:
            return False
        self.best, self.worst = max(self.best, *rewards), min(self.worst, *rewards)
        if any(r != rewards[0] for r in rewards):
            self.signal = True
            self.streak, self.values, self.said = 0, frozenset(), False
            return False
        self.streak += 1
        self.values = self.values | {float(rewards[0])}
        return True

    def learned(self, streak: int) -> float | None:
        """The reward the task is learned at, once, when the last `streak` groups all tied at
        the best reward and the policy earned less at some point; else None."""
        if (self.said or self.streak < streak or self.values != {self.best}
                or not self.worst < self.best):
            return None
        self.said = True
        return self.best


def learned_message(policy: str, groups: int, reward: float) -> str:
    """What the "learned" event says."""
    return (f"{policy}: the last {groups} groups all scored {reward:g}: the task is learned at "
            "this difficulty: its groups carry no signal, so steps from here teach "
            "little. Stop here (run.stop(), or train(..., stop_when_learned=True) next "
            "time), or make the task harder.")
