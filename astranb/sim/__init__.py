"""A cost-model simulator: astranb's real dataflow on simulated GPUs and a virtual clock.

Compare schedules of a GPU-scale multi-policy run on a laptop: the real Orchestrator, staleness
gate, buffers, barrier and TrainLoop drive simulated rollout engines (a GPU pool decoding
continuous batches with long-tail lengths and in-flight weight updates) and simulated trainers,
and virtual seconds pass only in the cost model.

    from astranb import sim

    result = sim.simulate(sim.astraflow_like())
    result.table()          # seconds per iteration, speedup vs the verl-style baseline, bound
    result.metrics          # the real Recorder's rows, one per (schedule, policy, step)

Rollouts over regions (pools behind slow links, weights relayed or pulled directly, routing by
measured throughput, autoscaling; crossregion.py, regions.py):

    r = sim.simulate_regions(sim.astraflow_crossregion(sync="relay", routing="throughput"))
    r.fraction              # achieved throughput / the pools' summed capacity

Needs `trio` (the virtual clock is trio's MockClock): `pip install trio`.
"""

from __future__ import annotations

import dataclasses

from .autoscale import Autoscale, Scaling, Signals
from .costs import Lengths, LengthSchedule, RolloutCosts, TrainCosts, Workload
from .crossregion import (
    RegionResult,
    RegionSimConfig,
    astraflow_crossregion,
    simulate_regions,
    varying_demand,
)
from .engine import GpuPool, SimEngine
from .environment import Solver, SolverVerifier
from .network import Link, LinkSpec, transfer_seconds
from .payload import QWEN3_8B, QWEN3_14B, ModelWeights, measured_bytes_per_change
from .regions import Pool, Region, RegionPublisher, RegionRollout
from .simulate import SCHEDULES, ScheduleResult, SimConfig, SimResult, run_virtual, simulate
from .trainer import SimPublisher, SimTrainer, TrainPool

__all__ = [
    "simulate",
    "astraflow_like",
    "SimConfig",
    "SimResult",
    "ScheduleResult",
    "SCHEDULES",
    "RolloutCosts",
    "TrainCosts",
    "Workload",
    "Lengths",
    "GpuPool",
    "SimEngine",
    "SimTrainer",
    "SimPublisher",
    "TrainPool",
    "SolverVerifier",
    "Solver",
    "run_virtual",
    # cross-region rollout and autoscaling
    "simulate_regions",
    "astraflow_crossregion",
    "varying_demand",
    "RegionSimConfig",
    "RegionResult",
    "Region",
    "Pool",
    "RegionRollout",
    "RegionPublisher",
    "LinkSpec",
    "Link",
    "transfer_seconds",
    "ModelWeights",
    "measured_bytes_per_change",
    "QWEN3_14B",
    "QWEN3_8B",
    "LengthSchedule",
    "Autoscale",
    "Signals",
    "Scaling",
]


def astraflow_like(placement: str | None = None, **overrides) -> SimConfig:
    """AstraFlow's multi-policy run, roughly: an 8B-class solver + verifier, 8 rollout GPUs and
    8 training GPUs, costs set so that rolling out and training a batch take comparable time.

    The numbers (SimConfig's defaults): a decode step costs 15 ms + 0.2 ms per sequence (41 ms
    for a full batch of 128, ~3.2k tokens/s per GPU), prefill 50k tokens/s, training 1.6e-4
    GPU-seconds per token (~6k tokens/s per GPU) plus 2 s per step, 2 s to load new weights.
    A step trains 512 episodes (64 problems x 8); solver answers are lognormal around 1500
    tokens (sigma 0.9, at most 8192), verdicts around 256 (at most 1024), and the verifier reads
    the problem and the answer. An iteration then needs ~54 s of rollout and ~62 s of training
    at full efficiency, while the longest answer alone takes 2-5 minutes to decode.

    Args:
        placement: "shared" (default: one trainer service for both policies, taking turns on
            all the training GPUs) or "split" (4 GPUs per policy, AstraFlow's layout).
        **overrides: SimConfig fields.
    """
    config = SimConfig(**overrides)
    if placement is not None:
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, placement=placement))
    return config
