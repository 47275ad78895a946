"""Autoscaling rollout capacity from what the dataflow shows: queue depth and trainer idle time.

What the signals say. In an asynchronous run the staleness gate keeps a bounded amount of work
admitted, split between work waiting for a rollout slot (the queue), work being generated, and
finished groups waiting for the trainer (the buffer's backlog). Each signal alone misleads: the
queue jumps after every train step (the gate admits a whole batch at once) even when GPUs are
plenty; an idle trainer with an empty queue waits on the long tail, which more GPUs do not
shorten; a short backlog means only that production and consumption are about equal. And the
trainer starts idling only once the backlog is used up, too late for GPUs that take minutes to
start.

The default rule therefore matches throughput. It measures the tokens the trainers could
consume per second if they never waited (`demand`: episodes trained per second of stepping, x
the tokens per episode finished lately; trainer idle time does not dilute it; each look's
estimate is averaged half and half with the previous one, since a look sees 0-2 train steps)
and the tokens one GPU decodes per second with full batches (`gpu_rate`, measured:
`GpuPool.batch_rate`). The GPUs needed are demand / (gpu_rate x `utilization`): `utilization`
below 1 is the headroom for weight updates, the long tail and demand growing while new GPUs
start. It adds GPUs up to that number when work waits in the queue (otherwise more GPUs would
have nothing to start), and drains `step` GPUs per look while the number is at least `step`
below what serves and the trainer did not wait in the last interval.

Capacity is not instant: a GPU asked for serves after `startup_seconds` (provisioning, loading
the weights) and is billed from the moment it was asked for. Removing capacity drains: the GPU
takes no new work, hands the sequences queued on it (not started) to the other GPUs and leaves
once the ones it is decoding have finished (`engine.GpuPool.drain`), so no episode is lost.

`Autoscale(policy=fn)` replaces the rule with any callable from `Signals` to the GPUs to add
(> 0) or drain (< 0). Whatever a rule returns is clamped to [min_gpus, max_gpus].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from .engine import GpuPool

__all__ = ["Autoscale", "Signals", "Scaling", "autoscale"]


@dataclass(frozen=True)
class Signals:
    """What an autoscaling rule sees at each look (averages over the last interval)."""

    time: float
    """Virtual seconds since the run began."""
    steps: int
    """Train steps taken so far (the fewest over the policies)."""
    gpus: int
    """GPUs serving (taking new work) now."""
    starting: int
    """GPUs asked for and still starting."""
    draining: int
    """GPUs finishing their last sequences before they leave."""
    queue: float
    """Queue depth: work waiting in front of the pool (sequences queued for a batch slot, plus
    episodes waiting for the pool's weights) per serving GPU, in full batches (`max_batch`)."""
    ready: float
    """Finished groups waiting for the trainer, in batches (the least over the policies)."""
    trainer_idle: float
    """Fraction of the interval the trainers were not stepping (waiting for batches)."""
    demand: float
    """Real tokens per second the trainers could consume when they never wait: episodes
    trained per second of stepping (over the last interval with a finished step) x the tokens
    per episode of the episodes finished lately (0 before the first step)."""
    gpu_rate: float
    """Measured real tokens per second one GPU decodes with full batches (0 before any)."""


@dataclass(frozen=True)
class Scaling:
    """One decision that changed the pool."""

    time: float
    pool: str
    change: int
    """GPUs asked for (> 0) or set draining (< 0)."""
    gpus: int
    """GPUs serving or starting after the change."""
    signals: Signals


@dataclass(frozen=True)
class Autoscale:
    """An autoscaling rule for one rollout pool (see the module docstring)."""

    min_gpus: int = 1
    """Never fewer serving + starting GPUs than this."""
    max_gpus: int = 64
    """Never more serving + starting GPUs than this."""
    interval: float = 60.0
    """Seconds between two looks at the signals."""
    startup_seconds: float = 120.0
    """Seconds from asking for a GPU to its first request (billed)."""
    utilization: float = 0.9
    """Share of the measured full-batch rate the needed GPUs are sized for (the headroom)."""
    up_queue: float = 0.1
    """Add only when at least this many batches per GPU wait for a slot."""
    step: int = 1
    """GPUs drained per look."""
    down_idle: float = 0.02
    """Drain only when the trainer idled at most this fraction of the interval."""
    samples: int = 12
    """Looks at the pool per interval that the queue and backlog average."""
    policy: Callable[[Signals], int] | None = None
    """A rule of your own: signals -> GPUs to add (> 0) or drain (< 0); replaces the above."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise ValueError(f"need 1 <= min_gpus <= max_gpus, got min_gpus={self.min_gpus}, "
                             f"max_gpus={self.max_gpus} (a pool keeps at least one GPU)")
        if self.interval <= 0 or self.startup_seconds < 0 or self.step < 1 or self.samples < 1:
            raise ValueError(f"need interval > 0, startup_seconds >= 0, step >= 1 and "
                             f"samples >= 1, got interval={self.interval}, "
                             f"startup_seconds={self.startup_seconds}, step={self.step}, "
                             f"samples={self.samples}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization is a share of the full-batch rate in (0, 1], got "
                             f"{self.utilization}")

    def needed(self, s: Signals) -> int | None:
        """GPUs that would produce what the trainers consume (None: nothing measured yet)."""
        if s.steps == 0 or s.gpu_rate <= 0 or s.demand <= 0:
            return None  # the pipeline is still filling: nothing to read yet
        return math.ceil(s.demand / (s.gpu_rate * self.utilization))

    def decide(self, s: Signals) -> int:
        """GPUs to add (> 0) or drain (< 0) given the signals; 0 to hold."""
        if self.policy is not None:
            return int(self.policy(s))
        needed = self.needed(s)
        if needed is None:
            return 0
        have = s.gpus + s.starting
        if needed > have and s.queue >= self.up_queue:
            return needed - have
        if needed <= have - self.step and not s.starting and s.trainer_idle <= self.down_idle:
            return -self.step
        return 0

    def clamp(self, change: int, s: Signals) -> int:
        """`change` within [min_gpus, max_gpus] counting serving and starting GPUs."""
        have = s.gpus + s.starting
        return max(self.min_gpus - have, min(self.max_gpus - have, change))


async def autoscale(rule: Autoscale, name: str, gpus: GpuPool, *, waiting: Callable[[], int],
                    ready: Callable[[], float], steps: Callable[[], int],
                    consumed: Callable[[], float], finished: Callable[[], tuple[int, int]],
                    trainer_busy: Callable[[float], float], trainer_stepped: Callable[[], float],
                    started: float,
                    log: list[Scaling], on_join: Callable[[], None] = lambda: None) -> None:
    """Apply `rule` to the pool `gpus` until cancelled (run it in the simulation's task group).

    Args:
        rule: the rule.
        name: the pool's name (for the log).
        gpus: the pool.
        waiting: episodes routed to the pool that wait for its weights (not yet on a GPU).
        ready: batches of finished groups waiting for the trainer.
        steps: train steps taken so far.
        consumed: episodes the trainers have trained so far.
        finished: (episodes, real tokens) finished by the rollouts so far.
        trainer_busy: mean seconds the training pools have stepped up to a time.
        trainer_stepped: mean seconds of finished steps of the training pools.
        started: when the run began (signal times count from it).
        log: every decision that changed the pool is appended here.
        on_join: called when a started GPU begins serving (the router looks again).
    """
    starting = 0

    async def start_one(asked: float) -> None:
        nonlocal starting
        await anyio.sleep(rule.startup_seconds)
        gpus.add_gpu(since=asked)
        starting -= 1
        on_join()

    async with anyio.create_task_group() as tg:
        last = anyio.current_time()
        busy_then, consumed_then, stepped_then = trainer_busy(last), consumed(), trainer_stepped()
        episodes_then, tokens_then = finished()
        per_episode = per_second = demand = 0.0
        while True:
            queue = backlog = 0.0
            for _ in range(rule.samples):  # averages over the interval
                await anyio.sleep(rule.interval / rule.samples)
                slots = max(1, len(gpus.serving)) * gpus.costs.max_batch
                queue += (gpus.queued + waiting()) / slots / rule.samples
                backlog += ready() / rule.samples
            now = anyio.current_time()
            busy_now, consumed_now, stepped_now = trainer_busy(now), consumed(), trainer_stepped()
            episodes_now, tokens_now = finished()
            idle = min(1.0, max(0.0, 1.0 - (busy_now - busy_then) / (now - last)))
            last, busy_then = now, busy_now
            if episodes_now > episodes_then:  # tokens per episode lately (answers may grow)
                per_episode = (tokens_now - tokens_then) / (episodes_now - episodes_then)
                episodes_then, tokens_then = episodes_now, tokens_now
            if stepped_now > stepped_then and consumed_now > consumed_then:
                per_second = (consumed_now - consumed_then) / (stepped_now - stepped_then)
                consumed_then, stepped_then = consumed_now, stepped_now
            # half this look's estimate, half the previous one's: one look sees 0-2 steps
            demand = per_second * per_episode if not demand else \
                0.5 * demand + 0.5 * per_second * per_episode
            serving = len(gpus.serving)
            signals = Signals(now - started, steps(), serving, starting,
                              len(gpus.gpus) - serving, queue, backlog, idle, demand,
                              gpus.batch_rate() or 0.0)
            change = rule.clamp(rule.decide(signals), signals)
            if change > 0:
                for _ in range(change):
                    starting += 1
                    tg.start_soon(start_one, now)
            elif change < 0:
                change = -sum(gpus.drain() for _ in range(-change))
            if change:
                log.append(Scaling(now - started, name, change,
                                   len(gpus.serving) + starting, signals))
