"""One run's dataflow, assembled in one place: gate, buffers, orchestrator, barrier, train loops.

    sources ──► Orchestrator ──(groups)──► Buffer per policy ──► TrainLoop per policy
                    ▲  admits under the StalenessGate          │ step, publish, release
                    └──────────────────────────────────────────┘

The Session builds a `Dataflow` for every `train()` (with a `RemoteEpisodes` when rollout
services play the episodes) and the simulator builds the same object on its virtual clock, so
both run exactly the same parts in exactly the same way.

With a `HeldOut` plan the run also evaluates while it trains: each time the policies of the
evaluated environment have published a multiple of `every` versions (version 0 included, and the
final version always), one *window* plays the held-out samples k times each on the same engines
(or rollout services), alongside training and without pausing it. Window episodes go through
`orchestrator.play_heldout`: never counted, recorded as episodes, or put in a buffer. Each window
is recorded as an "evaluation" event. A window that is still playing when new versions are
published is not interrupted; the versions passed meanwhile are skipped (the next window plays
the newest), and the run ends only after the window of the final version.

A watchdog lives as long as the run: when the run stops moving it records a "stalled" event
saying what the run waits for (see `stall`), so a run that makes no progress says so.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..contracts import PolicyHandle, RemoteEpisodes, RunRecorder
from ..environments.base import Environment
from ..evaluation import evaluate_trajectories, window_columns
from .barrier import VersionBarrier
from .buffer import Buffer
from .config import RunConfig
from .loop import TrainLoop
from .orchestrator import Orchestrator, Source, play_heldout
from .sampling import OpenSamples, filter_budget, learned_streak
from .staleness import StalenessGate
from .stall import PolicyWait, Snapshot, StallWatch, describe, filter_streak, filtered_message

__all__ = ["Dataflow", "HeldOut"]

_POLL = 0.02
"""Seconds between two looks at the published versions while no window is due."""
_WATCH = 0.25
"""Most seconds between two looks of the watchdog (less when `stall_seconds` is shorter)."""


@dataclass(frozen=True)
class HeldOut:
    """What a run evaluates while it trains (`session.train`'s eval_* arguments, validated)."""

    env: Environment
    """The environment played (its held-out split)."""
    wiring: Mapping[str, PolicyHandle]
    """Role -> policy; all of them trained by the run."""
    samples: tuple[Mapping[str, Any], ...]
    """The held-out problems: the same ones in every window."""
    k: int
    """Plays per problem (avg@k, pass@k)."""
    every: int
    """Versions between two windows."""
    split: str
    """The split the samples came from (recorded)."""


class Dataflow:
    """The parts of one run, wired together; `await flow.run()` runs them to the end.

    Args:
        sources: the wired environments.
        config: the run's settings (each policy trains `config.steps` steps from its version now).
        recorder: where rows, events and episodes go.
        remote: rollout services that play the episodes (None: played in this process).
        workers: concurrent group workers (None: the staleness gate's capacity).
        heldout: what to evaluate while training (None: nothing).
        targets: policy name -> the version it trains to (default: its version now plus
            `config.steps`); a resumed run goes on to the interrupted run's targets.
        checkpoint: writes a checkpoint of a policy, every `checkpoint_every` versions.
        time_offset: seconds added to every row's `time` (a resumed run's clock goes on from
            its checkpoint's).
    """

    def __init__(self, sources: Sequence[Source], config: RunConfig, recorder: RunRecorder, *,
                 remote: RemoteEpisodes | None = None, workers: int | None = None,
                 heldout: HeldOut | None = None, targets: Mapping[str, int] | None = None,
                 checkpoint: Callable[[PolicyHandle], Coroutine[Any, Any, None]] | None = None,
                 checkpoint_every: int = 0, time_offset: float = 0.0):
        self.config, self.remote, self.recorder = config, remote, recorder
        self.policies = {n: p for src in sources for n, p in src.policies.items()}
        self.gate = StalenessGate(self.policies, config.groups_per_batch, config.max_staleness)
        self.buffers = {name: Buffer(name, config.order) for name in self.policies}
        self.orchestrator = Orchestrator(
            list(sources), self.buffers, self.gate, recorder, group_size=config.group_size,
            seed=config.seed, max_consecutive_failures=max(64, 2 * config.batch_size),
            remote=remote,
            filter_budget=filter_budget(config.max_gen_batches, config.groups_per_batch),
            learned_after=learned_streak(config.groups_per_batch),
            on_learned=self._learned if config.stop_when_learned else None,
            open_samples=OpenSamples(seed=config.seed) if config.sampler == "open" else None)
        barrier = VersionBarrier(self.policies) if config.mode == "barrier" else None
        self.loops = [
            TrainLoop(p, self.buffers[n], self.gate, recorder, self.orchestrator.counters,
                      (targets or {}).get(n, p.version + config.steps), config.groups_per_batch,
                      config.max_staleness, remote=remote, barrier=barrier,
                      checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                      inspect_every=config.inspect_every)
            for n, p in self.policies.items()
        ]
        self.workers = workers or self.gate.capacity
        self.time_offset = time_offset
        self.heldout = heldout
        if heldout is not None:
            untrained = {p.name for p in heldout.wiring.values()} - set(self.policies)
            if untrained:
                raise ValueError(f"held-out evaluation of {heldout.env.name}: policies "
                                 f"{sorted(untrained)} are not trained by this run; wire them "
                                 "to a trained environment or evaluate another environment")
        self.windows = 0
        """Evaluation windows recorded so far."""
        self._evaluating = False
        if remote is not None:
            remote.start_run(sources)

    @property
    def trained_twice(self) -> int:
        """Episodes trained on more than once (must stay 0)."""
        return sum(loop.trained_twice for loop in self.loops)

    async def run(self, *also: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run until every policy has taken its steps; rollouts are then cancelled. With a
        `HeldOut` plan the run ends only once the final version's evaluation window is in.

        Args:
            *also: more background tasks that live exactly as long as the run (the simulator's
                GPUs).
        """
        started = anyio.current_time()  # the event loop's clock (virtual in the simulator)
        for loop in self.loops:
            loop.started = started - self.time_offset
        self.orchestrator.started = started - self.time_offset
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, started - self.time_offset)
            if self.remote is not None:
                tg.start_soon(self.remote.run)
            for task in also:
                tg.start_soon(task)
            async with anyio.create_task_group() as awaited:
                if self.heldout is not None:
                    awaited.start_soon(self._evaluate, self.heldout, started - self.time_offset)
                async with anyio.create_task_group() as rollouts:
                    rollouts.start_soon(self.orchestrator.run, self.workers)
                    async with anyio.create_task_group() as trainers:
                        for loop in self.loops:
                            trainers.start_soon(loop.run)
                    rollouts.cancel_scope.cancel()  # all policies trained: stop the rollouts
            tg.cancel_scope.cancel()  # and the last evaluation window is in: stop the rest

    async def _watch(self, started: float) -> None:
        """The watchdog: a "stalled" event when no step is published and no group reaches a
        buffer for `stall_seconds`, or after a quarter of it when a policy's last groups were
        all dropped by filter_groups; each said once per stall."""
        watch = StallWatch(self.config.stall_seconds, anyio.current_time())
        streak = filter_streak(self.config.groups_per_batch)
        said: set[str] = set()  # policies whose current filter_groups streak was reported
        while True:
            await anyio.sleep(min(_WATCH, self.config.stall_seconds / 4))
            now = anyio.current_time()
            progress = (tuple(loop.published for loop in self.loops),
                        self.orchestrator.delivered)
            busy = self._evaluating or any(loop.doing in ("publish", "checkpoint")
                                           for loop in self.loops)
            stalled = watch.look(now, progress, busy)
            filtered = self.orchestrator.filtered
            said &= set(filtered)  # a kept group ends a streak: the next one is said again
            # a streak is said once the run has not moved for a quarter of stall_seconds: an
            # untrained policy's first groups often all score 0 until one gets lucky
            for name, (groups, rewards) in filtered.items():
                if (groups >= streak and name not in said
                        and watch.idle(now) >= self.config.stall_seconds / 4):
                    said.add(name)
                    self._stalled(now - started, "filter_groups", [name], ["buffer"],
                                  filtered_message(name, groups, sorted(rewards)))
            if stalled:
                waiting, message = describe(self.snapshot(now, watch.idle(now)))
                self._stalled(now - started, "no_progress", sorted(self.policies), waiting,
                              message)

    def _learned(self, policy: str) -> None:
        """`stop_when_learned`: the policy whose task is learned ends after its current step."""
        for loop in self.loops:
            if loop.policy.name == policy:
                loop.end_early()

    def snapshot(self, now: float, idle: float) -> Snapshot:
        """The run's state for the watchdog (`now` on the event loop's clock)."""
        gate, orchestrator = self.gate, self.orchestrator
        policies = tuple(
            PolicyWait(loop.policy.name, loop.doing, len(loop.buffer),
                       self.config.groups_per_batch, gate.live[loop.policy.name], gate.capacity,
                       None if loop.step_started is None else now - loop.step_started,
                       orchestrator.filtered.get(loop.policy.name, (0, ()))[0])
            for loop in self.loops)
        starts = orchestrator.in_flight.values()
        return Snapshot(idle, policies, len(starts), now - min(starts) if starts else None,
                        all(src.samples is None for src in orchestrator.sources))

    def _stalled(self, time: float, reason: str, policies: list[str], waiting: list[str],
                 message: str) -> None:
        self.recorder.add_event("stalled", {"time": time, "reason": reason, "policies": policies,
                                            "waiting_for": waiting, "message": message})

    async def _evaluate(self, heldout: HeldOut, started: float) -> None:
        """Play a window whenever one is due, until the final version's window is in.

        A window is due when a multiple of `every` lies between the version after the last
        window (or the first version) and the published version now; it plays that newest
        version. The final version always gets a window."""
        names = {p.name for p in heldout.wiring.values()}
        loops = [loop for loop in self.loops if loop.policy.name in names]
        floor = min(loop.published for loop in loops)  # lowest version a window is owed for
        while True:
            final = min(loop.steps for loop in loops)  # lowered by a loop that ends early
            version = min(loop.published for loop in loops)
            multiple = version // heldout.every * heldout.every  # the newest one reached
            if multiple >= floor or version >= final >= floor:
                await self._window(heldout, version, started)
                floor = version + 1
            if version >= final and floor > version:
                return
            await anyio.sleep(_POLL)

    async def _window(self, heldout: HeldOut, version: int, started: float) -> None:
        t0 = anyio.current_time()
        index, self.windows = self.windows, self.windows + 1
        self._evaluating = True  # the watchdog counts a window as the run moving
        try:
            plays = await play_heldout(heldout.env, heldout.wiring, heldout.samples, heldout.k,
                                       remote=self.remote, group=-1 - index, version=version)
        finally:
            self._evaluating = False
        results = evaluate_trajectories(plays, heldout.env.roles, heldout.k, heldout.split,
                                        heldout.env.solved)
        now = anyio.current_time()
        # the episodes are not recorded, so the window keeps what went wrong with them
        error = next((t.error for problem in plays for t in problem if not t.ok), None)
        self.recorder.add_event("evaluation", {
            "window": index, "version": version, "time": now - started, "seconds": now - t0,
            "env": heldout.env.name, "split": heldout.split, **window_columns(results),
            "first_error": error})
