"""Run astranb's real dataflow on simulated GPUs and a virtual clock, and compare schedules.

`simulate(config)` plays each schedule with the real Orchestrator, StalenessGate, Buffer,
VersionBarrier and TrainLoop, driving simulated engines (engine.py) and trainers (trainer.py).
It runs under anyio's trio backend with `trio.testing.MockClock(autojump_threshold=0)`: whenever
every task waits, the clock jumps to the next deadline, so an hour of GPU time takes a moment.

Schedules (all on the same rollout GPUs and training GPUs):

- "independent": astranb async, each policy steps when its batch is ready; rollouts run up to
  `max_staleness` versions ahead, on the rollout GPUs while training runs on the others.
- "barrier": the same, but versions advance together (AstraFlow's barrier).
- "sync": astranb with max_staleness=0 (nothing generated ahead); with placement "shared" it is
  the baseline, with "split" the policies train side by side.
- "baseline": verl-style synchronous multi-policy RL: roll out a full batch, train policy 1 on
  all training GPUs, then policy 2, publish, repeat. It is astranb's max_staleness=0 dataflow
  with both trainers sharing one pool of all the training GPUs, so they take turns.
- "colocated": the baseline as verl really runs it: every GPU (rollout + training) rolls out,
  then every GPU trains; a stronger baseline than "baseline", reported beside it.

The astranb schedules train as `TrainCosts.placement` says: "shared" puts both policies on all
the training GPUs, taking turns (one astranb trainer service for every policy); "split" gives
each its own share (AstraFlow's one trainer per model).

An iteration is one step of every policy. Seconds per iteration are measured after `warmup`
iterations (the pipeline filling). The ideal overlap bound per iteration is
max(rollout work / rollout GPUs, training work / training GPUs), with rollout work the expected
GPU-seconds of a batch of episodes at full batches (costs.RolloutCosts.ideal_gpu_seconds over
the workload's lengths; more episodes when groups are filtered out) and training work the
GPU-seconds the trainers spent. Stale drops, half-empty batches, re-prefills after weight
updates and idle GPUs all count against a schedule. (For "colocated" the same GPUs do both, so
its bound is the sum over all GPUs.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import torch

from ..algorithms import GRPO
from ..dataflow.config import RunConfig
from ..dataflow.flow import Dataflow
from ..dataflow.orchestrator import Source
from ..session.recorder import Recorder
from .costs import RolloutCosts, TrainCosts, Workload, ideal_episode_seconds
from .engine import GpuPool, SimEngine
from .environment import SolverVerifier
from .trainer import SimTrainer, TrainPool, sim_policy

if TYPE_CHECKING:
    import pandas

    from ..dataflow.loop import TrainLoop

__all__ = ["SCHEDULES", "SimConfig", "ScheduleResult", "SimResult", "simulate", "run_virtual"]

SCHEDULES = ("independent", "barrier", "sync", "baseline", "colocated")
POLICIES = ("solver", "verifier")


@dataclass(frozen=True)
class SimConfig:
    """A simulated run: hardware, workload and astranb's knobs."""

    rollout: RolloutCosts = RolloutCosts()
    """Rollout GPUs and their costs."""
    training: TrainCosts = TrainCosts()
    """Training GPUs and their costs."""
    workload: Workload = Workload()
    """Episode shape and lengths."""
    steps: int = 14
    """Train steps per policy."""
    batch_size: int = 512
    """Episodes per step."""
    group_size: int = 8
    """Episodes per sample."""
    max_staleness: int = 6
    """Bound of the async schedules (the sync ones use 0)."""
    order: str = "edf"
    """Buffer order, "edf" or "fifo"."""
    workers: int | None = None
    """Group workers of the async schedules; None: the gate's capacity (as Session does)."""
    filter_groups: bool = False
    """Dynamic sampling: drop groups whose rewards are all equal (GRPO's filter_groups)."""
    warmup: int = 4
    """Iterations of the async schedules left out of the steady-state seconds per iteration."""
    sync_steps: int = 4
    """Steps of the synchronous schedules: their iterations are alike after the first (which is
    left out), so a few suffice."""
    seed: int = 0
    """Seed of lengths, outcomes and the scheduler's tie-breaking."""
    schedules: tuple[str, ...] = SCHEDULES
    """Which schedules to run (the baseline is needed for speedups)."""
    max_virtual_seconds: float = 1e7
    """A run still going after this much virtual time fails (a deadlock guard)."""

    def __post_init__(self) -> None:
        unknown = set(self.schedules) - set(SCHEDULES)
        if unknown:
            raise ValueError(f"unknown schedule(s) {sorted(unknown)}; choose from {SCHEDULES}")
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of "
                             f"group_size={self.group_size}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"need 0 <= warmup < steps, got warmup={self.warmup}, "
                             f"steps={self.steps}")
        if self.sync_steps < 2:
            raise ValueError(f"sync_steps must be >= 2 (the first iteration is left out), "
                             f"got {self.sync_steps}")
        if self.max_staleness < 1:
            raise ValueError("max_staleness is the async schedules' bound and must be >= 1 "
                             "(the 'sync' and 'baseline' schedules already use 0)")

    @property
    def groups_per_batch(self) -> int:
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class ScheduleResult:
    """One schedule's numbers (times in virtual seconds)."""

    name: str
    """Schedule name (see SCHEDULES)."""
    seconds_per_iteration: float
    """Steady-state time for every policy to take one step."""
    bound_seconds: float
    """Ideal overlap bound per iteration: max(rollout_bound, train_bound)."""
    rollout_bound: float
    """Rollout work per iteration / rollout GPUs."""
    train_bound: float
    """Training work per iteration / training GPUs."""
    bound_fraction: float
    """bound_seconds / seconds_per_iteration (1.0: perfect overlap)."""
    busiest_trainer: float
    """Seconds per iteration the busiest training pool computes: a bound that, unlike
    train_bound, counts how the GPUs were split between policies."""
    speedup: float
    """Baseline seconds per iteration / this schedule's (nan without a baseline run)."""
    staleness_max: int
    """Largest staleness of any trained group."""
    dropped_stale: int
    """Groups dropped at pop for being too stale (their rollouts were wasted)."""
    rollout_utilization: float
    """Busy rollout GPU-seconds / (GPUs x run time)."""
    virtual_seconds: float
    """Length of the whole run."""
    real_seconds: float
    """Wall-clock seconds the simulation took."""


@dataclass(frozen=True)
class SimResult:
    """What `simulate` returns."""

    config: SimConfig
    """The configuration simulated."""
    schedules: dict[str, ScheduleResult]
    """Per-schedule numbers."""
    metrics: pandas.DataFrame = field(repr=False)
    """The real Recorder's rows of every schedule, with a "schedule" column."""

    def table(self) -> pandas.DataFrame:
        """One row per schedule: the numbers side by side."""
        import pandas as pd

        rows = [dataclasses.asdict(r) for r in self.schedules.values()]
        return pd.DataFrame(rows).set_index("name")


def simulate(config: SimConfig = SimConfig(), directory: str | Path | None = None) -> SimResult:
    """Run every schedule of `config` on the virtual clock.

    Args:
        config: hardware, workload, knobs and schedules.
        directory: where the Recorder writes (one folder per schedule); a temporary folder if None.

    Example:
        >>> from astranb import sim
        >>> result = sim.simulate(sim.astraflow_like(steps=12))   # doctest: +SKIP
        >>> result.table()[["seconds_per_iteration", "speedup", "bound_fraction"]]  # doctest: +SKIP
    """
    import pandas as pd

    if _loop_running():  # a notebook cell: build and run everything in a thread of its own
        return _in_thread(simulate, config, directory)
    with contextlib.ExitStack() as stack:
        root = Path(directory) if directory is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="astranb-sim-")))
        results, frames = {}, []
        for name in config.schedules:
            result, rows = _run_schedule(config, name, root / name)
            results[name] = result
            frames.append(pd.DataFrame(rows).assign(schedule=name))
    base = results.get("baseline")
    if base is not None:
        results = {n: dataclasses.replace(r, speedup=base.seconds_per_iteration
                                          / r.seconds_per_iteration)
                   for n, r in results.items()}
    return SimResult(config, results, pd.concat(frames, ignore_index=True))


def run_virtual(fn, *args, seed: int = 0):
    """Run `await fn(*args)` under trio with a MockClock that jumps whenever all tasks wait.

    Tasks made runnable at the same virtual instant run in an order trio picks at random. Trio's
    deterministic scheduling (the switch its Hypothesis plugin turns on: tasks in spawn order,
    then shuffled by its generator) is switched on and seeded here, and restored after, so the
    same seed gives the same run in a script, a notebook and under pytest. Called where an event
    loop runs (a notebook cell), it runs in a worker thread: trio cannot start inside asyncio.
    """
    if _loop_running():
        return _in_thread(run_virtual, fn, *args, seed=seed)
    try:
        import trio.testing
    except ImportError:
        raise ImportError("astranb.sim runs on trio's virtual clock: pip install trio") from None
    from trio._core import _run as trio_run  # private: the scheduler's switch and generator

    clock = trio.testing.MockClock(autojump_threshold=0)
    saved = trio_run._r.getstate(), trio_run._ALLOW_DETERMINISTIC_SCHEDULING
    # trio declares the flag Final; switching it on is the private hook this relies on
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    trio_run._r.seed(seed)
    try:
        return anyio.run(fn, *args, backend="trio", backend_options={"clock": clock})
    finally:
        trio_run._r.setstate(saved[0])
        trio_run._ALLOW_DETERMINISTIC_SCHEDULING = saved[1]  # type: ignore[misc]  # Final, above


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _in_thread(fn, *args, **kwargs):
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="astranb-sim") as pool:
        return pool.submit(fn, *args, **kwargs).result()


# -- one schedule ------------------------------------------------------------------------------

@dataclass
class _Setup:
    gpus: GpuPool
    train_pools: list[TrainPool]
    policies: dict
    env: SolverVerifier
    max_staleness: int
    mode: str
    workers: int | None
    colocated: bool
    steps: int
    warmup: int


def _setup(config: SimConfig, schedule: str) -> _Setup:
    w, rollout, training = config.workload, config.rollout, config.training
    colocated = schedule == "colocated"
    if colocated:  # every GPU rolls out, then every GPU trains
        everything = rollout.gpus + training.gpus
        rollout = dataclasses.replace(rollout, gpus=everything)
        pools = [TrainPool(everything)] * len(POLICIES)
    elif schedule == "baseline" or training.placement == "shared":
        pools = [TrainPool(training.gpus)] * len(POLICIES)
    else:
        pools = [TrainPool(g) for g in training.gpus_of(len(POLICIES))]
    gpus = GpuPool(rollout, w.token_scale)
    lengths = {"solver": w.solver, "verifier": w.verifier}
    policies = {}
    for name, pool in zip(POLICIES, pools, strict=True):
        engine = SimEngine(name, gpus, lengths[name], seed=config.seed)
        trainer = SimTrainer(pool, training, w.token_scale)
        policies[name] = sim_policy(name, engine, trainer, GRPO(filter_groups=config.filter_groups))
    asynchronous = schedule in ("independent", "barrier")
    return _Setup(gpus, list({id(p): p for p in pools}.values()), policies,
                  SolverVerifier(w, config.seed),
                  max_staleness=config.max_staleness if asynchronous else 0,
                  mode="barrier" if schedule == "barrier" else "independent",
                  workers=config.workers if asynchronous else None,
                  colocated=colocated,
                  steps=config.steps if asynchronous else config.sync_steps,
                  warmup=config.warmup if asynchronous else 1)


def _run_schedule(config: SimConfig, schedule: str, directory: Path):
    # every episode: _overgeneration counts the finished episodes of each group
    recorder = Recorder(directory, {name: lambda ids: "" for name in POLICIES}, record="all")
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batches are small here; more threads only contend
    try:  # (anyio's Events and Locks must be made inside the loop that uses them)
        setup, loops, end = run_virtual(_play, config, schedule, recorder, seed=config.seed)
    finally:
        torch.set_num_threads(threads)
        recorder.close()
    real = time.perf_counter() - started
    rows = recorder.rows
    return _summarise(config, schedule, setup, recorder, loops, rows, end, real), rows


async def _play(config: SimConfig, schedule: str, recorder: Recorder):
    """The pieces assembled as Session._run_main assembles them, on simulated hardware."""
    s = _setup(config, schedule)
    source = Source(s.env, {"solver": s.policies["solver"], "verifier": s.policies["verifier"]},
                    seed=config.seed)
    run_config = RunConfig(s.steps, config.batch_size, config.group_size, s.max_staleness,
                           config.order, config.seed, s.mode)
    flow = Dataflow([source], run_config, recorder, workers=s.workers)
    started = anyio.current_time()
    with anyio.fail_after(config.max_virtual_seconds):
        await flow.run(s.gpus.run)
    return s, flow.loops, anyio.current_time() - started


def _summarise(config, schedule, setup, recorder, loops, rows, end, real) -> ScheduleResult:
    per_iter = _seconds_per_iteration(rows, setup.steps, setup.warmup)
    rollout_work = _rollout_work(config, setup, recorder, loops)
    train_work = sum(p.gpu_seconds for p in setup.train_pools) / setup.steps
    if setup.colocated:  # the same GPUs do both, one after the other
        everything = config.rollout.gpus + config.training.gpus
        rollout_bound, train_bound = rollout_work / everything, train_work / everything
        bound = rollout_bound + train_bound
    else:
        rollout_bound = rollout_work / config.rollout.gpus
        train_bound = train_work / config.training.gpus
        bound = max(rollout_bound, train_bound)
    return ScheduleResult(
        name=schedule,
        seconds_per_iteration=per_iter,
        bound_seconds=bound,
        rollout_bound=rollout_bound,
        train_bound=train_bound,
        bound_fraction=bound / per_iter,
        busiest_trainer=max(p.gpu_seconds / p.gpus for p in setup.train_pools) / setup.steps,
        speedup=float("nan"),
        staleness_max=max(int(r["staleness_max"]) for r in rows),
        dropped_stale=sum(loop.dropped_stale for loop in loops),
        rollout_utilization=setup.gpus.busy_seconds / (len(setup.gpus.gpus) * end),
        virtual_seconds=end,
        real_seconds=real,
    )


def _seconds_per_iteration(rows: list[dict], steps: int, warmup: int) -> float:
    """Time between the ends of iterations `warmup` and `steps` (an iteration ends when the
    last policy has finished that step), per iteration."""
    ends = [max(r["time"] for r in rows if r["step"] == i) for i in range(steps)]
    start = ends[warmup - 1] if warmup else 0.0
    return (ends[-1] - start) / (steps - warmup)


def _rollout_work(config: SimConfig, setup: _Setup, recorder: Recorder,
                  loops: list[TrainLoop]) -> float:
    """Ideal rollout GPU-seconds per iteration: the expected work of an episode times the
    episodes an iteration needs (more than a batch when groups are filtered out)."""
    extra = _overgeneration(config, setup.steps, recorder, loops)
    return _episode_work(config) * config.batch_size * extra


def _episode_work(config: SimConfig, draws: int = 20_000) -> float:
    """Expected ideal GPU-seconds of one episode (Monte Carlo over the workload's lengths)."""
    return ideal_episode_seconds(config.workload, config.rollout, draws=draws, seed=config.seed)


def _overgeneration(config: SimConfig, steps: int, recorder: Recorder,
                    loops: list[TrainLoop]) -> float:
    """Finished groups per group a policy could use (1 unless groups are filtered out)."""
    if not config.filter_groups:
        return 1.0
    finished = Counter(e.group for e in recorder.episodes)
    complete = sum(n == config.group_size for n in finished.values())
    delivered = min(steps * config.groups_per_batch + loop.dropped_stale + len(loop.buffer)
                    for loop in loops)
    return max(1.0, complete / delivered)
