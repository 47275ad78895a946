"""Noticing a run that makes no progress, and saying what it waits for.

A run can stop moving without anything failing: the staleness gate is full and the trainer does
not step, every group is dropped by `filter_groups` because every reward is the same, an episode
never ends, a barrier waits on a policy that cannot step. Nothing raises, so nothing would show.
The run's watchdog (`Dataflow`'s) looks a few times a second at what the parts expose and
records a "stalled" event in two cases:

- *no progress*: no step was published and no group reached a buffer for `stall_seconds`
  (`session.train(stall_seconds=...)`, `STALL_SECONDS` by default), while no evaluation window,
  checkpoint or weight transfer was under way (a train step is not such work: one that runs
  longer than `stall_seconds` is reported, as what the run waits for). The event says what each
  policy waits for: the barrier, its buffer (how many of the groups a batch needs are there),
  the trainer (a step running for how long), the gate (live groups against its capacity), and
  the groups in flight (how many, how long the oldest has played).
- *nothing to learn from*: the last `filter_streak(groups_per_batch)` groups a policy played
  were all dropped by `filter_groups` (every episode of each earned the same reward), and the
  run has not moved for a quarter of `stall_seconds` (30 s by default: an untrained policy's
  first groups often all score 0 until one gets lucky); said with what to do about it.

One event per stall: the watchdog says it again only after the run moved (a step, or a group
kept) and stopped again. The parts here are pure (they read plain numbers), so the tests drive
them directly; `Dataflow` feeds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STALL_SECONDS", "filter_streak", "PolicyWait", "Snapshot", "describe",
           "filtered_message", "StallWatch"]

STALL_SECONDS = 120.0
"""Seconds without a published step or a group reaching a buffer before a run is `stalled`."""


def filter_streak(groups_per_batch: int) -> int:
    """Groups in a row dropped by `filter_groups` before a policy is said to be stalled: four
    batches' worth, and at least 8 (a run of ties that long is no longer bad luck)."""
    return max(8, 4 * groups_per_batch)


@dataclass(frozen=True)
class PolicyWait:
    """What one trained policy is doing now, as the watchdog sees it."""

    policy: str
    """The policy's name."""
    doing: str
    """"barrier" (waiting for the other policies), "buffer" (waiting for groups), "trainer"
    (a step is running), "publish" (sending new weights), "checkpoint" or "done"."""
    buffered: int
    """Groups in its buffer."""
    needed: int
    """Groups one step takes."""
    live: int
    """Groups the staleness gate counts as live for it (in flight, buffered, being trained)."""
    capacity: int
    """The gate's capacity: no new group starts while `live` is at it."""
    step_seconds: float | None = None
    """How long the running step has run (None: no step running)."""
    filtered: int = 0
    """Groups dropped by `filter_groups` in a row (0 once one is kept)."""


@dataclass(frozen=True)
class Snapshot:
    """The run's state at one look of the watchdog."""

    idle_seconds: float
    """Seconds since the last published step or group that reached a buffer."""
    policies: tuple[PolicyWait, ...]
    """Each trained policy's state."""
    in_flight: int
    """Groups being played."""
    oldest_seconds: float | None
    """How long the oldest group in flight has played (None: none in flight)."""
    streams_ended: bool = False
    """Every sample stream has ended."""


def describe(snap: Snapshot) -> tuple[list[str], str]:
    """What the run waits for: (the things, short names out of "barrier", "buffer", "trainer",
    "gate", "episodes in flight", "samples"; one sentence saying it all)."""
    waits: list[str] = []
    parts: list[str] = []
    for p in snap.policies:
        if p.doing == "trainer":
            waits.append("trainer")
            took = "" if p.step_seconds is None else f" for {p.step_seconds:.0f} s"
            parts.append(f"{p.policy}'s trainer has been running a step{took}")
        elif p.doing == "barrier":
            waits.append("barrier")
            parts.append(f"{p.policy} waits at the barrier for the other policies' steps")
        elif p.doing == "buffer":
            waits.append("buffer")
            parts.append(f"{p.policy} waits for its buffer ({p.buffered} of the {p.needed} "
                         "groups a step takes are there)")
        if p.doing != "done" and p.live >= p.capacity:
            waits.append("gate")
            parts.append(f"the staleness gate admits no new group for {p.policy} "
                         f"({p.live} live of {p.capacity}: they are released when a step "
                         "that trains them is published)")
        if p.filtered:
            parts.append(f"the last {p.filtered} groups of {p.policy} were dropped by "
                         "filter_groups")
    if snap.in_flight:
        waits.append("episodes in flight")
        oldest = "" if snap.oldest_seconds is None else \
            f", the oldest for {snap.oldest_seconds:.0f} s"
        parts.append(f"{snap.in_flight} group(s) of episodes are playing{oldest}")
    elif snap.streams_ended:
        waits.append("samples")
        parts.append("every sample stream has ended")
    else:
        parts.append("no episode is playing")
    waiting = list(dict.fromkeys(waits))
    message = (f"no step and no new group for {snap.idle_seconds:.0f} s: " + "; ".join(parts)
               + ". run.episodes[-1].show() steps through the last episode kept; run.stop() "
               "stops the run.")
    return waiting, message


def filtered_message(policy: str, groups: int, rewards: Sequence[float]) -> str:
    """What to say when `policy`'s last `groups` groups were all dropped by `filter_groups`;
    `rewards` are the distinct rewards its episodes earned meanwhile."""
    distinct = sorted(set(rewards))
    if len(distinct) == 1:
        earned = f"every reward was {distinct[0]!r}"
    else:
        shown = ", ".join(repr(r) for r in distinct[:5]) + (", ..." if len(distinct) > 5 else "")
        earned = f"within each group every episode earned the same reward ({shown})"
    return (f"the last {groups} groups of {policy} were all dropped by filter_groups: {earned}, "
            "so no group has a signal to learn from and no step can be taken. Start from a "
            "policy that sometimes succeeds (a warm start: policy.sft(...) or a stronger "
            "model), use easier samples, or give the algorithm filter_groups=False (e.g. "
            "ab.GRPO(filter_groups=False)) to take steps anyway (their advantages are 0 until "
            "rewards differ within a group).")


class StallWatch:
    """When to say a run is stalled: the time side of the watchdog, on any clock.

    `look(now, progress)` gets a value that changes whenever the run moves (the published
    versions and the groups delivered); it answers True once per stall, when the value has
    not changed for `seconds`.
    """

    def __init__(self, seconds: float, now: float):
        if not seconds > 0:
            raise ValueError(f"stall_seconds must be > 0, got {seconds!r}")
        self.seconds = seconds
        self.since = now
        """When the run last moved (or the watch started)."""
        self._seen: object = None
        self._said = False

    def look(self, now: float, progress: object, busy: bool = False) -> bool:
        """Whether to say "stalled" now (True at most once until the run moves again).
        `busy`: useful work is under way that moves no counter (an evaluation window, a
        checkpoint, weights being sent): the run counts as moving."""
        if busy or progress != self._seen:
            self._seen, self.since, self._said = progress, now, False
            return False
        if self._said or now - self.since < self.seconds:
            return False
        self._said = True
        return True

    def idle(self, now: float) -> float:
        """Seconds since the run last moved."""
        return now - self.since
