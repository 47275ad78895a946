"""The per-policy buffer between rollouts and the trainer.

Finished groups wait here until the trainer pops a batch. Order is EDF (earliest deadline first:
the group with the oldest token goes first, so the samples closest to the staleness bound are
trained before they expire) or FIFO (arrival order). The staleness bound is re-checked at pop:
a group whose oldest token is more than `max_staleness` versions behind is dropped there. Once
no group can come any more (`close`, when every sample stream has ended), a pop that the
waiting groups cannot serve raises `SamplesRanOut` instead of waiting forever. Once `cut`
(the policy's filter budget for the step is spent), a pop returns the groups it has, at least
one, instead of waiting for a full batch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from ..errors import SamplesRanOut
from ..types import Trajectory

__all__ = ["Group", "Buffer", "ORDERS"]

ORDERS = ("edf", "fifo")


@dataclass(frozen=True)
class Group:
    """Episodes that ran on one sample; advantages are normalised within it."""

    id: int
    """Run-wide group id."""
    trajectories: tuple[Trajectory, ...]
    """The successful episodes of the group."""
    admitted_version: int
    """Trainer version of the policy when the group was admitted."""
    policies: frozenset[str] = field(default_factory=frozenset)
    """Policies that made at least one turn in it."""
    key: str = ""
    """The sample's name in the run's streams (`ledger.sample_id`; "" when not from one)."""

    def min_version(self, policy: str) -> int:
        """Oldest token version among `policy`'s turns (-1 if it made none)."""
        versions = [t.min_version(policy) for t in self.trajectories]
        versions = [v for v in versions if v >= 0]
        return min(versions) if versions else -1


class Buffer:
    """Groups waiting to be trained by one policy.

    Args:
        policy: the policy name.
        order: "edf" or "fifo".
    """

    def __init__(self, policy: str, order: str = "edf"):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.policy = policy
        self.order = order
        self._heap: list[tuple[int, int, Group]] = []
        self._seq = itertools.count()
        self._added = anyio.Event()
        self._closed: str | None = None
        self._cut = False

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, group: Group) -> None:
        seq = next(self._seq)
        key = group.min_version(self.policy) if self.order == "edf" else seq
        heapq.heappush(self._heap, (key, seq, group))
        self._added.set()
        self._added = anyio.Event()

    async def pop(
        self,
        n: int,
        version: int,
        max_staleness: int,
        on_drop: Callable[[Group], None] = lambda group: None,
    ) -> list[Group]:
        """Wait for `n` groups fresh enough to train at `version`.

        A group found too stale on the way is dropped and handed to `on_drop` at once: its
        admission must be released right away, or a full gate could wait on a pop that waits
        on the gate.

        Raises:
            SamplesRanOut: the buffer is closed and holds fewer than `n` fresh groups (those it
                holds stay in it).
        """
        taken: list[tuple[int, int, Group]] = []
        try:
            while len(taken) < n:
                if not self._heap:
                    if self._cut and taken:  # the step takes what it has (see `cut`)
                        break
                    if self._closed is not None:
                        raise SamplesRanOut(f"{self.policy} needs {n} groups for a step and "
                                            f"{len(taken)} are left: {self._closed}")
                    await self._added.wait()
                    continue
                entry = heapq.heappop(self._heap)
                if version - entry[2].min_version(self.policy) > max_staleness:
                    on_drop(entry[2])
                else:
                    taken.append(entry)
        except BaseException:  # cancelled (or ran out) while waiting: what was taken goes back
            for entry in taken:
                heapq.heappush(self._heap, entry)
            raise
        self._cut = False
        return [group for _, _, group in taken]

    def cut(self) -> None:
        """The next pop (or the one waiting) returns the fresh groups there are, at least one,
        instead of waiting for `n`: the policy's filter budget is spent (see `sampling`)."""
        self._cut = True
        self._added.set()
        self._added = anyio.Event()

    def close(self, reason: str) -> None:
        """No group will be put any more (`reason` says why): a pop that cannot be served by
        the groups left raises `SamplesRanOut` with it, at once."""
        self._closed = reason
        self._added.set()
        self._added = anyio.Event()

    def drain(self) -> list[Group]:
        """Remove and return every waiting group."""
        groups = [g for _, _, g in self._heap]
        self._heap.clear()
        return groups
