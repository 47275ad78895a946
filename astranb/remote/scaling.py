"""Autoscaling a session's rollout services from its load: backlog and trainer idle time.

Every `interval` seconds of a run the `Autoscaler` looks at the run (`Load`), asks its rule how
many rollout services to add (> 0) or drain (< 0), clamps that to [min_services, max_services],
and acts:

    look --> rule(Load) --> +n: add() n times (in a thread: a start takes seconds), each URL
                 |              joins the pool and catches up before it gets work
                 +-----> -n: drain n services: no new work; the episodes they hold finish
                                and are collected; only then are they removed and remove(url)
                                stops them. Nothing is resubmitted and nothing is lost.

`add` and `remove` are the launcher's: `RayServices.add_rollout` / `remove_rollout` create and
remove Ray actors, `LocalServices.add_rollout` / `remove_rollout` processes on this machine. With
services started by hand, `add` may instead say what to start (print, page someone) and return
None; whoever starts it then calls `session.add_rollout(url)`.

The default rule (`BacklogRule`) reads the trainer's idle time. A trainer that waits for batches
(a large share of the interval) while episodes are in flight is starved by its rollouts: add one.
A trainer that never waits has more rollout capacity than it consumes: drain one, as long as more
than one serves. Any callable `Load -> int` can replace it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = ["Autoscaler", "BacklogRule", "Load", "Scaled"]


@dataclass(frozen=True)
class Load:
    """What a rule sees at each look."""

    time: float
    """Seconds since the autoscaler started."""
    services: int
    """Rollout services serving (ready and not draining)."""
    starting: int
    """Services asked for (add() called) and not serving yet."""
    draining: int
    """Services finishing their episodes before they leave."""
    queued: int
    """Episodes waiting in the session for a rollout slot."""
    inflight: int
    """Episodes on the serving services, not finished yet."""
    trainer_idle: float
    """Share of the last interval the trainers waited for batches (from the steps' rows;
    NaN before any step in the interval)."""
    steps: int
    """Train steps in the last interval."""


@dataclass(frozen=True)
class Scaled:
    """One change the autoscaler made."""

    time: float
    change: int
    """+1: a service was added; -1: one was drained and removed."""
    url: str | None
    services: int
    """Services serving after the change."""
    load: Load


@dataclass(frozen=True)
class BacklogRule:
    """Add a service while the trainer starves, drain one while it never waits.

    Attributes:
        idle_above: add one when the trainers waited at least this share of the interval and
            episodes are in flight or queued.
        idle_below: drain one when they waited at most this share (and more than one serves).
    """

    idle_above: float = 0.3
    idle_below: float = 0.05

    def __call__(self, load: Load) -> int:
        if load.starting or load.draining or load.steps == 0:
            return 0  # a change is under way, or nothing to judge by yet
        if load.trainer_idle >= self.idle_above and load.queued + load.inflight > 0:
            return 1
        if load.trainer_idle <= self.idle_below and load.services > 1:
            return -1
        return 0


@dataclass(eq=False)
class Autoscaler:
    """Adds and drains a session's rollout services during a run (`session.train(autoscale=)`).

    Args:
        add: starts one more rollout service and returns its URL (or None when someone else
            will call `session.add_rollout(url)`); called in a thread.
        remove: stops a drained service (called in a thread); None to leave it running.
        rule: `Load -> int` (default `BacklogRule()`).
        min_services, max_services: bounds on the services serving and starting.
        interval: seconds between looks.
    """

    add: Callable[[], str | None] | None = None
    remove: Callable[[str], Any] | None = None
    rule: Callable[[Load], int] = field(default_factory=BacklogRule)
    min_services: int = 1
    max_services: int = 4
    interval: float = 10.0
    history: list[Scaled] = field(default_factory=list)
    """Every change made, in order."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_services <= self.max_services:
            raise ValueError(f"need 1 <= min_services <= max_services, got {self.min_services} "
                             f"and {self.max_services}")
        if self.interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {self.interval}")
        if self.add is None and self.remove is None:
            raise ValueError("give add= (start a service, return its URL) and/or remove= (stop "
                             "one); e.g. services.autoscaler() of launch_ray or launch_local")
        self._starting = 0

    async def run(self, pool: Any, rows: Callable[[], Sequence[dict[str, Any]]],
                  event: Callable[[str, dict[str, Any]], None]) -> None:
        """Look every `interval` seconds until cancelled (the run's end)."""
        started, seen = time.monotonic(), len(rows())
        async with anyio.create_task_group() as tg:
            while True:
                await anyio.sleep(self.interval)
                new = list(rows())[seen:]
                seen += len(new)
                load = self._load(pool, new, time.monotonic() - started)
                change = self._clamp(int(self.rule(load)), load)
                for _ in range(max(change, 0)):
                    self._starting += 1
                    tg.start_soon(self._add, pool, load, event)
                for url in self._pick_drained(pool, -min(change, 0)):
                    tg.start_soon(self._drain, pool, url, load, event)

    def _load(self, pool: Any, rows: Sequence[dict[str, Any]], now: float) -> Load:
        serving = [m for m in pool.ready() if not m.draining]
        waited = sum(r.get("wait_seconds", 0.0) for r in rows)
        stepped = sum(r.get("step_seconds", 0.0) for r in rows)
        idle = waited / (waited + stepped) if waited + stepped > 0 else float("nan")
        return Load(time=now, services=len(serving), starting=self._starting,
                    draining=sum(1 for m in pool.members.values() if m.draining and not m.removed),
                    queued=pool.queued, inflight=sum(len(m.inflight) for m in serving),
                    trainer_idle=idle, steps=len(rows))

    def _clamp(self, change: int, load: Load) -> int:
        if change > 0 and self.add is None or change < 0 and self.remove is None:
            return 0
        total = load.services + load.starting
        return max(self.min_services - total, min(change, self.max_services - total))

    def _pick_drained(self, pool: Any, n: int) -> list[str]:
        """The n serving members with the least work in flight (never a region's relay first)."""
        if n <= 0:
            return []
        relays = set(pool.relays.values())
        serving = [m for m in pool.ready() if not m.draining]
        serving.sort(key=lambda m: (m.url in relays, len(m.inflight), m.url))
        return [m.url for m in serving[:n]]

    async def _add(self, pool: Any, load: Load, event: Callable[[str, dict], None]) -> None:
        assert self.add is not None
        try:
            url = await _call(self.add)
        finally:
            self._starting -= 1
        if url:
            pool.add(url)
        self._record(+1, url, pool, load, event)

    async def _drain(self, pool: Any, url: str, load: Load,
                     event: Callable[[str, dict], None]) -> None:
        await pool.drain(url)
        if self.remove is not None:
            await _call(self.remove, url)
        self._record(-1, url, pool, load, event)

    def _record(self, change: int, url: str | None, pool: Any, load: Load,
                event: Callable[[str, dict], None]) -> None:
        services = sum(1 for m in pool.ready() if not m.draining)
        self.history.append(Scaled(load.time, change, url, services, load))
        event("scaled", {"change": change, "url": url, "services": services,
                         "trainer_idle": load.trainer_idle, "inflight": load.inflight})


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await anyio.to_thread.run_sync(lambda: fn(*args))
    if isinstance(result, Awaitable):
        return await result
    return result
