"""One run's dataflow, assembled in one place: gate, buffers, orchestrator, barrier, train loops.

    sources ──► Orchestrator ──(groups)──► Buffer per policy ──► TrainLoop per policy
                    ▲  admits under the StalenessGate          │ step, publish, release
                    └──────────────────────────────────────────┘

The Session builds a `Dataflow` for every `train()` (with a `RemoteEpisodes` when rollout
services play the episodes) and the simulator builds the same object on its virtual clock, so
both run exactly the same parts in exactly the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio

from ..contracts import RemoteEpisodes, RunRecorder
from .barrier import VersionBarrier
from .buffer import Buffer
from .config import RunConfig
from .loop import TrainLoop
from .orchestrator import Orchestrator, Source
from .staleness import StalenessGate

__all__ = ["Dataflow"]


class Dataflow:
    """The parts of one run, wired together; `await flow.run()` runs them to the end.

    Args:
        sources: the wired environments.
        config: the run's settings (each policy trains `config.steps` steps from its version now).
        recorder: where rows, events and episodes go.
        remote: rollout services that play the episodes (None: played in this process).
        workers: concurrent group workers (None: the staleness gate's capacity).
    """

    def __init__(self, sources: Sequence[Source], config: RunConfig, recorder: RunRecorder, *,
                 remote: RemoteEpisodes | None = None, workers: int | None = None):
        self.config, self.remote = config, remote
        self.policies = {n: p for src in sources for n, p in src.policies.items()}
        self.gate = StalenessGate(self.policies, config.groups_per_batch, config.max_staleness)
        self.buffers = {name: Buffer(name, config.order) for name in self.policies}
        self.orchestrator = Orchestrator(
            list(sources), self.buffers, self.gate, recorder, group_size=config.group_size,
            seed=config.seed, max_consecutive_failures=max(64, 2 * config.batch_size),
            remote=remote)
        barrier = VersionBarrier(self.policies) if config.mode == "barrier" else None
        self.loops = [
            TrainLoop(p, self.buffers[n], self.gate, recorder, self.orchestrator.counters,
                      p.version + config.steps, config.groups_per_batch, config.max_staleness,
                      remote=remote, barrier=barrier)
            for n, p in self.policies.items()
        ]
        self.workers = workers or self.gate.capacity
        if remote is not None:
            remote.start_run(sources)

    @property
    def trained_twice(self) -> int:
        """Episodes trained on more than once (must stay 0)."""
        return sum(loop.trained_twice for loop in self.loops)

    async def run(self, *also: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run until every policy has taken its steps; rollouts are then cancelled.

        Args:
            *also: more background tasks that live exactly as long as the rollouts (the
                simulator's GPUs).
        """
        started = anyio.current_time()  # the event loop's clock (virtual in the simulator)
        for loop in self.loops:
            loop.started = started
        async with anyio.create_task_group() as tg:
            if self.remote is not None:
                tg.start_soon(self.remote.run)
            for task in also:
                tg.start_soon(task)
            tg.start_soon(self.orchestrator.run, self.workers)
            async with anyio.create_task_group() as trainers:
                for loop in self.loops:
                    trainers.start_soon(loop.run)
            tg.cancel_scope.cancel()  # all policies trained: stop the rollouts
