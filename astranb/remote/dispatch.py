"""Episodes to the rollout services and their results back: the pool's dispatch.

Episodes wait in one queue until a ready member has room; each goes to the member that would
finish it first (`astranb.remote.routing.split`, from each one's measured pace and weight-update
time), so a slow or far service gets less. A member that dies hands its in-flight episodes back
(`take_back`): they go to the front of the queue.

Episodes are identified by id. The first result for an id wins; any later one (a resubmitted
episode whose first copy still arrived) is acknowledged and discarded, so no episode is trained
twice and, since nothing leaves the accounting before its result is in, none is lost. A result
of an episode nobody waits for any more (abandoned when the training rollouts stopped, while a
held-out evaluation window still plays) is acknowledged and counted as `late`. Ids begin with a
tag drawn per run: results of an earlier run are recognised and ignored. `accounting()` reports
the totals.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..types import Trajectory
from .client import ServiceError, ServiceUnavailable
from .members import Member, Members
from .routing import split
from .serialize import trajectory_from_wire

__all__ = ["Dispatch"]

COUNTS = ("submitted", "completed", "resubmitted", "duplicates", "abandoned", "late",
          "stale_results", "failovers", "rejoins")
"""The run's accounting (`RolloutPool.counts`); failovers and rejoins are the membership's."""


@dataclass
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    result: Trajectory | None = None


class Dispatch:
    """The queue of episodes, who waits for which id, and the run's accounting.

    Args:
        members: the pool's members (who is ready, and what to do when a call fails).
        poll_wait: seconds to wait for room before looking again (the members' heartbeat).
    """

    def __init__(self, members: Members, poll_wait: float):
        self.members, self.poll_wait = members, poll_wait
        self.queue: deque[dict] = deque()
        self._queued = anyio.Event()
        self._waiting: dict[str, _Waiter] = {}
        self._abandoned: set[str] = set()
        self.tag = ""
        self.counts: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        """A new run: a new id tag, an empty queue, accounting from zero."""
        self.tag = uuid.uuid4().hex[:8]
        self.queue.clear()
        self._abandoned.clear()
        self.counts = dict.fromkeys(COUNTS, 0)

    async def play(self, env_key: int, samples: Sequence[tuple[str, dict[str, Any], int, int]]
                   ) -> list[Trajectory]:
        """Queue episodes (id, sample, group, admitted version) of a registered environment and
        wait for their trajectories, in order. Cancelled (the run ended), those not in yet are
        abandoned: their results will be dropped as `late`."""
        waiters = []
        for episode_id, sample, group, admitted in samples:
            waiter = self._waiting.setdefault(episode_id, _Waiter())
            waiters.append(waiter)
            self.queue.append({"id": episode_id, "env": env_key, "sample": sample,
                               "group": group, "started_version": admitted})
            self.counts["submitted"] += 1
        self.wake()
        try:
            for waiter in waiters:
                await waiter.event.wait()
        finally:
            for episode_id, *_ in samples:
                left = self._waiting.pop(episode_id, None)
                if left is not None and left.result is None:
                    self.counts["abandoned"] += 1  # the run ended (or was stopped) first
                    self._abandoned.add(episode_id)
        results = []
        for waiter in waiters:
            assert waiter.result is not None  # its event is set only once the result is in
            results.append(waiter.result)
        return results

    def deliver(self, result: dict) -> None:
        """A finished episode from a member: the first result for its id wins."""
        if not result["id"].startswith(self.tag):
            self.counts["stale_results"] += 1  # from an earlier run
            return
        waiter = self._waiting.get(result["id"])
        if waiter is None and result["id"] in self._abandoned:
            # nobody waits any more (the training rollouts stopped while a held-out evaluation
            # window still plays on): acknowledged and dropped, not a duplicate
            self._abandoned.discard(result["id"])
            self.counts["late"] += 1
            return
        if waiter is None or waiter.result is not None:
            self.counts["duplicates"] += 1
            return
        waiter.result = trajectory_from_wire(result)
        self.counts["completed"] += 1
        waiter.event.set()

    def take_back(self, member: Member) -> None:
        """`member` died: what it held that someone still waits for goes to the queue's front."""
        if member.inflight:
            self.counts["failovers"] += 1
        for item in member.inflight.values():
            if item["id"] in self._waiting:
                self.counts["resubmitted"] += 1
                self.queue.appendleft(item)
        self.wake()

    def accounting(self) -> dict[str, int]:
        """This run's episode accounting. Every submitted episode is completed, still awaited, or
        abandoned because the run ended first; `lost` counts the rest and must be 0."""
        waiting = len(self._waiting)
        c = self.counts
        lost = c["submitted"] - c["completed"] - c["abandoned"] - waiting
        return {**c, "awaited": waiting, "lost": lost}

    def wake(self) -> None:
        """Something changed (work queued, room freed, a member ready): look again."""
        self._queued.set()

    async def run(self) -> None:
        """Send queued episodes to members with room, until cancelled."""
        while True:
            if not self.queue:
                await self._wait()
                continue
            targets = [m for m in self.members.ready() if m.room > 0]
            if not targets:
                await self._wait(timeout=self.poll_wait)
                if not self.members.ready():
                    self.members.check_patience()
                continue
            # each episode to the service that would finish it first (astranb.remote.routing)
            counts = split(min(len(self.queue), 4096), [m.room for m in targets],
                           [len(m.inflight) for m in targets], [m.pace.rate for m in targets],
                           [m.sync_seconds for m in targets])
            for member, count in zip(targets, counts, strict=True):
                items = [self.queue.popleft() for _ in range(count)]
                items = [i for i in items if i["id"] in self._waiting]  # not abandoned meanwhile
                if items:
                    await self._submit(member, items)

    async def _submit(self, member: Member, items: list[dict]) -> None:
        for item in items:
            member.inflight[item["id"]] = item
        wire = [dict(i, env_id=member.env_ids[i["env"]]) for i in items]
        for w in wire:
            w.pop("env")
        try:
            await member.client.submit(wire)
        except (ServiceUnavailable, ServiceError):
            self.members.missed(member)
            if member.state == "ready":
                member.state = "suspect"
            # the service may or may not have them: keep them in its accounting until it answers
            # (then they arrive) or it is declared dead (then they are resubmitted)

    async def _wait(self, timeout: float | None = None) -> None:
        self._queued = anyio.Event()
        with anyio.move_on_after(timeout if timeout is not None else math.inf):
            await self._queued.wait()
