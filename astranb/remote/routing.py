"""Where queued episodes go: to the rollout service that would finish them first.

Pools differ: a GPU node plays episodes faster than a CPU one, a service far from the trainer
spends longer on each weight update. Sending work by free slots alone lets a slow service take as
much as a fast one, and the batch waits for its long tail (or its episodes come back too stale to
train on). So each service's pace is measured and each episode goes where it would be finished
soonest:

    finish(m) = lag(m) + (inflight(m) + 1) / rate(m)

rate: the episodes per second it finished while it had work (`Pace`, a decaying average, so a
service that slows down is seen within about `horizon` seconds); lag: the seconds its last weight
update took. Episodes are assigned one at a time, each to the service with the smallest finish
time that still has room. A service without a measured rate yet counts at the median of the
measured ones (all at 1 when none is measured: the split is then by in-flight counts alone).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Pace", "split"]


@dataclass
class Pace:
    """Episodes finished per second of having work, averaged with a decay of `horizon` s."""

    horizon: float = 30.0
    done: float = 0.0
    busy: float = 0.0

    def observe(self, seconds: float, finished: int, had_work: bool) -> None:
        """`finished` episodes came in over the last `seconds` (busy if it `had_work`)."""
        if seconds <= 0:
            return
        keep = math.exp(-seconds / self.horizon)
        self.done = self.done * keep + finished
        self.busy = self.busy * keep + (seconds if had_work or finished else 0.0)

    @property
    def rate(self) -> float | None:
        """Episodes per second, or None before a second of work was seen."""
        return self.done / self.busy if self.busy >= 1.0 and self.done > 0 else None


def split(n: int, room: Sequence[int], inflight: Sequence[int],
          rate: Sequence[float | None], lag: Sequence[float]) -> list[int]:
    """How many of `n` queued episodes each service gets (the lists are per service).

    Returns:
        counts, one per service, summing to min(n, total room).
    """
    known = [r for r in rate if r is not None and r > 0]
    default = statistics.median(known) if known else 1.0
    pace = [r if r is not None and r > 0 else default for r in rate]
    counts = [0] * len(room)
    heap = [(lag[i] + (inflight[i] + 1) / pace[i], i) for i in range(len(room)) if room[i] > 0]
    heapq.heapify(heap)
    for _ in range(n):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < room[i]:
            heapq.heappush(heap, (lag[i] + (inflight[i] + counts[i] + 1) / pace[i], i))
    return counts
