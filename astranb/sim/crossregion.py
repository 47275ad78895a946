"""Simulate a run whose rollouts are spread over regions, and what autoscaling them saves.

`simulate_regions(config)` plays one run with the real Dataflow (gate, buffer, TrainLoop,
Recorder) on the virtual clock, its episodes played by `regions.RegionRollout`: pools in
regions, weights over links, routing, optional autoscaling. It answers two questions:

- How close do far, slower pools get to their capacity? `fraction` is achieved throughput (the
  batch's episodes per second of steady state, after `warmup` steps) over the ideal: the pools'
  summed capacity (GPUs x speed, at full batches, `costs.ideal_episode_seconds` per episode)
  over the work per episode. Idle GPUs, weight updates and re-prefills, groups dropped as stale,
  and a pool that holds batches back all count against it.
- What does capacity cost? `rollout_gpu_hours` sums every rollout GPU's billed time (start-up
  included, until it leaves); `training_gpu_hours` is the training GPUs over the run;
  `time_to_target` is when every policy has taken its `steps`.

`astraflow_crossregion()` is AstraFlow's cross-region setting; `varying_demand()` a single-region
run whose answers change length with a curriculum (the autoscaling comparison).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..algorithms import GRPO
from ..dataflow.config import RunConfig
from ..dataflow.flow import Dataflow
from ..dataflow.orchestrator import Source
from ..models import ModelSpec
from ..session.policy import Policy
from ..session.recorder import Recorder
from ..training.local import AdamWConfig
from .autoscale import Autoscale, Scaling
from .costs import (
    Lengths,
    LengthSchedule,
    RolloutCosts,
    TrainCosts,
    Workload,
    ideal_episode_seconds,
)
from .environment import Solver, SolverVerifier
from .network import LinkSpec
from .payload import QWEN3_14B, ModelWeights
from .regions import (
    ROUTINGS,
    SYNCS,
    Pool,
    Region,
    RegionPublisher,
    RegionRollout,
    SyncRecord,
    check_layout,
)
from .simulate import _in_thread, _loop_running, _seconds_per_iteration, run_virtual
from .trainer import SimTokenizer, SimTrainer, TrainPool

if TYPE_CHECKING:
    import pandas

__all__ = ["RegionSimConfig", "RegionResult", "simulate_regions", "astraflow_crossregion",
           "varying_demand"]


@dataclass(frozen=True)
class RegionSimConfig:
    """A run on pools in regions: hardware, links, workload and the scheduler's choices."""

    regions: tuple[Region, ...]
    """Where pools sit, and their links from the trainer."""
    pools: tuple[Pool, ...]
    """The rollout pools."""
    rollout: RolloutCosts = RolloutCosts()
    """Per-GPU rollout costs at speed 1 (its `gpus` is not used: each Pool says its own)."""
    training: TrainCosts = TrainCosts()
    """Training GPUs and their costs."""
    workload: Workload = Workload()
    """Prompt and lengths."""
    schedule: LengthSchedule | None = None
    """Solver lengths that change with the version (None: the workload's)."""
    weights: ModelWeights = QWEN3_14B
    """Wire sizes of each policy's weights."""
    verifier: bool = False
    """Solver + verifier (two policies) instead of the solver alone."""
    sync: str = "relay"
    """"relay" or "direct" (regions.py)."""
    routing: str = "throughput"
    """"throughput" or "round_robin" (regions.py)."""
    max_lag: int = 1
    """Versions a pool may be behind the trainer and still get new work."""
    full_every: int = 10
    """A full snapshot every this many versions (the weight store's default; 0: never forced)."""
    steps: int = 16
    """Train steps per policy."""
    batch_size: int = 512
    """Episodes per step."""
    group_size: int = 8
    """Episodes per sample."""
    max_staleness: int = 4
    """The staleness bound."""
    warmup: int = 4
    """Steps left out of the steady-state throughput."""
    seed: int = 0
    """Seed of lengths, outcomes and scheduling ties."""
    record: str = "none"
    """Which episodes the Recorder keeps ("none", "sample", "all"): rows always have the
    token versions; keep episodes only to look at them."""
    max_virtual_seconds: float = 1e7
    """A run still going after this much virtual time fails (a deadlock guard)."""

    def __post_init__(self) -> None:
        if self.sync not in SYNCS or self.routing not in ROUTINGS:
            raise ValueError(f"sync must be one of {SYNCS} and routing one of {ROUTINGS}; got "
                             f"sync={self.sync!r}, routing={self.routing!r}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"need 0 <= warmup < steps, got warmup={self.warmup}, "
                             f"steps={self.steps}")
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of "
                             f"group_size={self.group_size}")
        check_layout(self.regions, self.pools)

    @property
    def policies(self) -> tuple[str, ...]:
        return ("solver", "verifier") if self.verifier else ("solver",)

    def solver_lengths(self, version: int) -> Lengths:
        return self.schedule.at(version) if self.schedule is not None else self.workload.solver

    @property
    def capacity(self) -> float:
        """The pools' summed GPUs x speed at the start (speed-1 GPUs)."""
        return sum(p.gpus * p.speed for p in self.pools)

    def ideal_step_seconds(self, version: int) -> float:
        """Seconds a step's episodes need at the pools' summed capacity and full batches."""
        work = _ideal_episode(self.workload, self.rollout, self.solver_lengths(version),
                              self.verifier, self.seed)
        return self.batch_size * work / self.capacity


@functools.lru_cache(maxsize=256)
def _ideal_episode(workload: Workload, rollout: RolloutCosts, solver: Lengths, verifier: bool,
                   seed: int) -> float:
    return ideal_episode_seconds(workload, rollout, solver, verifier, seed=seed)


@dataclass(frozen=True)
class RegionResult:
    """What `simulate_regions` returns (times in virtual seconds)."""

    config: RegionSimConfig
    seconds_per_step: float
    """Steady state (after the warm-up): time for every policy to take one step."""
    ideal_seconds_per_step: float
    """The same at the pools' summed capacity (mean over the measured steps)."""
    fraction: float
    """ideal / achieved: the share of the pools' capacity turned into trained episodes."""
    episodes_per_second: float
    """Achieved: batch_size / seconds_per_step."""
    ideal_episodes_per_second: float
    """batch_size / ideal_seconds_per_step."""
    time_to_target: float
    """When every policy had taken its steps."""
    rollout_gpu_hours: float
    """Every rollout GPU's billed time (start-up included) until it left or the run ended."""
    training_gpu_hours: float
    """Training GPUs x the run's length."""
    link_bytes: dict[str, float]
    """Bytes over each region's link from the trainer."""
    syncs: dict[str, dict[str, float]]
    """Per region: deltas and fulls pulled, mean and max seconds until in use."""
    work_share: dict[str, float]
    """Per pool: its share of the episodes routed after the warm-up (the first routing, before
    anything is measured, spreads the gate's first max_staleness + 1 batches by GPU count)."""
    capacity_share: dict[str, float]
    """Per pool: its share of the summed capacity."""
    staleness_max: int
    """Largest staleness of any trained group."""
    dropped_stale: int
    """Groups dropped at pop as too stale (wasted rollouts)."""
    accounting: dict[str, int]
    """Episodes submitted, completed, abandoned at the end, lost (0), drained sequences."""
    scaling: tuple[Scaling, ...]
    """Every autoscaling decision that changed a pool."""
    gpus_final: dict[str, int]
    """Per pool: GPUs serving at the end."""
    virtual_seconds: float
    real_seconds: float
    metrics: pandas.DataFrame = field(repr=False)
    """The real Recorder's rows (one per policy and step)."""
    sync_log: tuple[SyncRecord, ...] = field(repr=False, default=())
    """Every version's trip to every region."""

    def summary(self) -> dict[str, Any]:
        """The headline numbers as one flat dict."""
        return {"sync": self.config.sync, "routing": self.config.routing,
                "seconds_per_step": self.seconds_per_step,
                "episodes_per_second": self.episodes_per_second,
                "ideal_episodes_per_second": self.ideal_episodes_per_second,
                "fraction": self.fraction, "time_to_target": self.time_to_target,
                "rollout_gpu_hours": self.rollout_gpu_hours,
                "training_gpu_hours": self.training_gpu_hours,
                "link_gb": sum(self.link_bytes.values()) / 1e9,
                "staleness_max": self.staleness_max, "dropped_stale": self.dropped_stale,
                "lost": self.accounting["lost"], "real_seconds": self.real_seconds}


def simulate_regions(config: RegionSimConfig,
                     directory: str | Path | None = None) -> RegionResult:
    """Play `config` once on the virtual clock (see the module docstring).

    Args:
        config: pools, regions, workload, scheduler.
        directory: where the Recorder writes; a temporary folder if None.

    Example:
        >>> from astranb import sim
        >>> r = sim.simulate_regions(sim.astraflow_crossregion(steps=8))  # doctest: +SKIP
        >>> r.fraction, r.link_bytes                                      # doctest: +SKIP
    """
    import pandas as pd

    if _loop_running():  # a notebook cell: trio runs in a thread of its own
        return _in_thread(simulate_regions, config, directory)
    with contextlib.ExitStack() as stack:
        root = Path(directory) if directory is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="astranb-sim-")))
        recorder = Recorder(root, {name: lambda ids: "" for name in config.policies},
                            record=config.record)
        started = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # batches are small here; more threads only contend
        try:
            rollout, loops, train_pools, begin, end = run_virtual(
                _play, config, recorder, seed=config.seed)
        finally:
            torch.set_num_threads(threads)
            recorder.close()
        real = time.perf_counter() - started
        rows = recorder.rows
    return _summarise(config, rollout, loops, train_pools, begin, end, real,
                      pd.DataFrame(rows), rows)


async def _play(config: RegionSimConfig, recorder: Recorder):
    """The pieces assembled as Session._run_main assembles them with rollout services."""
    w, training = config.workload, config.training
    n = len(config.policies)
    if training.placement == "shared":
        pools = [TrainPool(training.gpus)] * n
    else:
        pools = [TrainPool(g) for g in training.gpus_of(n)]
    train_pools = list({id(p): p for p in pools}.values())
    lengths: dict[str, Lengths | LengthSchedule] = {
        "solver": config.schedule if config.schedule is not None else w.solver}
    if config.verifier:
        lengths["verifier"] = w.verifier
    rollout = RegionRollout(
        config.regions, config.pools, config.rollout, lengths,
        dict.fromkeys(config.policies, config.weights), token_scale=w.token_scale,
        sync=config.sync, routing=config.routing, max_lag=config.max_lag,
        full_every=config.full_every, train_pools=train_pools, seed=config.seed)
    policies = {name: _policy(name, SimTrainer(pool, training, w.token_scale), rollout)
                for name, pool in zip(config.policies, pools, strict=True)}
    if config.verifier:
        env: Solver | SolverVerifier = SolverVerifier(w, config.seed)
    else:
        cap = config.schedule.cap if config.schedule is not None else None
        env = Solver(w, config.seed, cap=cap)
    source = Source(env, {name: policies[name] for name in config.policies}, seed=config.seed)
    run_config = RunConfig(config.steps, config.batch_size, config.group_size,
                           config.max_staleness, "edf", config.seed, "independent")
    flow = Dataflow([source], run_config, recorder, remote=rollout)
    rollout.watch_buffers(list(flow.buffers.values()), run_config.groups_per_batch,
                          run_config.batch_size)
    begin = anyio.current_time()
    with anyio.fail_after(config.max_virtual_seconds):
        await flow.run()
    return rollout, flow.loops, train_pools, begin, anyio.current_time()


def _policy(name: str, trainer: SimTrainer, rollout: RegionRollout) -> Policy:
    """A simulated policy whose versions are announced to the regions."""
    return Policy(name, ModelSpec(f"sim-{name}"), GRPO(filter_groups=False), AdamWConfig(),
                  None, trainer, RegionPublisher(rollout, name, trainer), SimTokenizer())


def _summarise(config: RegionSimConfig, rollout: RegionRollout, loops, train_pools, begin: float,
               end: float, real: float, metrics, rows: list[dict]) -> RegionResult:
    per_step = _seconds_per_iteration(rows, config.steps, config.warmup)
    ideal = sum(config.ideal_step_seconds(v) for v in range(config.warmup, config.steps)) \
        / (config.steps - config.warmup)
    steady = {p.spec.name: sum(n for v, n in p.routed_at.items() if v >= config.warmup)
              for p in rollout.pools}
    routed = sum(steady.values()) or 1
    syncs: dict[str, dict[str, float]] = {}
    for region in rollout.regions:
        mine = [s for s in rollout.syncs if s.region == region.spec.name]
        kinds = Counter(s.kind for s in mine)
        seconds = [s.seconds for s in mine]
        syncs[region.spec.name] = {
            "deltas": kinds["delta"], "fulls": kinds["full"],
            "mean_seconds": sum(seconds) / len(seconds) if seconds else 0.0,
            "max_seconds": max(seconds, default=0.0)}
    return RegionResult(
        config=config,
        seconds_per_step=per_step,
        ideal_seconds_per_step=ideal,
        fraction=ideal / per_step,
        episodes_per_second=config.batch_size / per_step,
        ideal_episodes_per_second=config.batch_size / ideal,
        time_to_target=max(r["time"] for r in rows),
        rollout_gpu_hours=sum(p.gpus.gpu_seconds(end) for p in rollout.pools) / 3600,
        training_gpu_hours=sum(p.gpus for p in train_pools) * (end - begin) / 3600,
        link_bytes={r.spec.name: r.link.bytes for r in rollout.regions},
        syncs=syncs,
        work_share={name: n / routed for name, n in steady.items()},
        capacity_share={p.name: p.gpus * p.speed / config.capacity for p in config.pools},
        staleness_max=max(int(r["staleness_max"]) for r in rows),
        dropped_stale=sum(loop.dropped_stale for loop in loops),
        accounting=rollout.accounting(),
        scaling=tuple(rollout.scaling),
        gpus_final={p.spec.name: len(p.gpus.serving) for p in rollout.pools},
        virtual_seconds=end - begin,
        real_seconds=real,
        metrics=metrics,
        sync_log=tuple(rollout.syncs),
    )


# -- presets -----------------------------------------------------------------------------------

QWEN3_14B_ROLLOUT = RolloutCosts(gpus=1, max_batch=128, step_base=0.012, step_per_seq=0.0003,
                                 prefill_per_token=5e-5, update_seconds=1.0)
"""One H100-class GPU serving a 14B model: a decode step reads the 29.6 GB of weights (~12 ms)
plus ~0.3 ms per sequence of KV cache, so a full batch of 128 decodes ~2.5k tokens/s; prefill
20k tokens/s (~30 GFLOP a token at ~60% of the dense bf16 peak); loading a version takes ~1 s."""

QWEN3_14B_TRAINING = TrainCosts(gpus=32, gpu_seconds_per_token=3.4e-4, step_overhead=5.0)
"""Training a 14B model: ~1.2e11 FLOPs per token (forward, backward and the logprob recompute)
at ~350 TFLOP/s per GPU, plus 5 s per step of optimizer and gathers."""


def astraflow_crossregion(sync: str = "relay", routing: str = "throughput",
                          **overrides) -> RegionSimConfig:
    """AstraFlow's cross-region setting, for Qwen3-14B: three rollout pools at 100/60/30 %
    throughput (10, 6 and 3 GPUs of one kind), the first beside the trainer, the other two
    behind 4 Gbit/s links with a 300 ms round trip.

    Workload: 512-token prompts, answers lognormal around 1,500 tokens (sigma 0.9, at most
    8,192), 8,192 episodes a step (512 problems x 16, as DAPO trains), max_staleness 3, 12
    steps of which the first 4 are the pipeline filling. A step then needs ~375 s of the pools'
    summed capacity. It has to be that long: every version costs each GPU a ~1 s pause and the
    re-prefill of the ~128 sequences it is decoding (long ones, ~15-20 s at 20k tokens/s), so
    steps of a minute would spend a quarter of the pools on updates; and the longest answers
    (~7 min) fit in the bound. The trainer (32 GPUs, ~245 s a step) keeps up, so the pools set
    the pace. The trainer's region reaches its pool at 400 Gbit/s (the trainer's NICs) and
    pulls directly; services inside a region reach each other at 100 Gbit/s.

    Args:
        sync: "relay" or "direct".
        routing: "throughput" or "round_robin".
        **overrides: RegionSimConfig fields.
    """
    wan = LinkSpec(4e9, 0.3)
    regions = (Region("home", LinkSpec(400e9, 0.001), sync="direct"), Region("west", wan),
               Region("east", wan))
    pools = (Pool("home", "home", 10), Pool("west", "west", 6), Pool("east", "east", 3))
    workload = Workload(prompt_tokens=512, solver=Lengths(1500, 0.9, 8192), token_scale=64)
    config = RegionSimConfig(regions, pools, rollout=QWEN3_14B_ROLLOUT,
                             training=QWEN3_14B_TRAINING, workload=workload, weights=QWEN3_14B,
                             sync=sync, routing=routing, steps=12, warmup=4, batch_size=8192,
                             group_size=16, max_staleness=3)
    return dataclasses.replace(config, **overrides)


def varying_demand(gpus: int = 8, autoscale: Autoscale | None = None,
                   **overrides) -> RegionSimConfig:
    """A single-region Qwen3-14B run whose demand for rollouts changes with a curriculum:
    short answers for 8 versions (median 400 tokens), long ones for the next 8 (median 2,400:
    hard problems), short again for the last 8 (sigma 0.5, at most 8,192; prompts 1,024
    tokens); 1,024 episodes a step (128 problems x 8), 8 training GPUs (~70 s a step in the
    short phases, ~170 s in the long one), max_staleness 4 (4 steps hold the longest answers).
    The short phases are bound by training (prompts cost training more than rollout: ~4 rollout
    GPUs keep up), the long one by rollouts (~7-8 needed), so capacity sized for the long phase
    idles in the short ones: what autoscaling is for.

    Args:
        gpus: the pool's GPUs (fixed, or the start when `autoscale` is given).
        autoscale: a rule for the pool (None: static capacity).
        **overrides: RegionSimConfig fields.
    """
    regions = (Region("home", LinkSpec(400e9, 0.001), sync="direct"),)
    pools = (Pool("home", "home", gpus, autoscale=autoscale),)
    short, long = Lengths(400, 0.5, 8192), Lengths(2400, 0.5, 8192)
    workload = Workload(prompt_tokens=1024, solver=short, token_scale=64)
    training = dataclasses.replace(QWEN3_14B_TRAINING, gpus=8)
    config = RegionSimConfig(regions, pools, rollout=QWEN3_14B_ROLLOUT, training=training,
                             workload=workload,
                             schedule=LengthSchedule.phases((0, short), (8, long), (16, short)),
                             weights=QWEN3_14B, steps=24, warmup=2, batch_size=1024,
                             max_staleness=4)
    return dataclasses.replace(config, **overrides)
