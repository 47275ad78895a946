"""Simulated trainers, and the Policy that ties a simulated engine to one.

A SimTrainer's step sleeps for the cost model's step time (costs.py) on its TrainPool, the
training GPUs it owns; trainers that share a pool take turns (its lock), which is how the
baseline trains one policy after the other on all the GPUs. Its weights are nothing: publishing
is the engine's timed in-flight update.

A simulated policy is the real Policy with a `SimPublisher`, whose publish awaits the engine's
update on the event loop. The in-process publishers copy weights in a worker thread and wait on a
concurrent Future through asyncio; under the virtual clock a worker thread would let the clock
jump while it runs, and asyncio does not exist under trio. Everything else (train_step awaiting
an async trainer, version, algorithm) is Policy's own code.
"""

from __future__ import annotations

from typing import Any

import anyio

from ..algorithms import GRPO
from ..contracts import Publisher, Trainer
from ..models import ModelSpec
from ..session.policy import Policy
from ..training.local import AdamWConfig
from ..types import Batch
from .costs import TrainCosts
from .engine import SimEngine

__all__ = ["TrainPool", "SimTrainer", "SimPublisher", "SimTokenizer", "sim_policy"]


class TrainPool:
    """Training GPUs owned by one trainer, or shared by trainers that take turns.

    Args:
        gpus: how many.
    """

    def __init__(self, gpus: int):
        self.gpus = gpus
        self.lock = anyio.Lock()
        self.gpu_seconds = 0.0
        """GPU-seconds of steps run so far."""
        self.stepped = 0.0
        """Seconds of finished steps (the pool's busy time, not counting the step under way)."""
        self.stepping_since: float | None = None
        """When the step under way began (None while idle)."""

    def busy_seconds(self, now: float) -> float:
        """Seconds the pool has spent stepping up to `now` (the step under way included): what
        an autoscaler reads the trainer's idle time from."""
        running = 0.0 if self.stepping_since is None else now - self.stepping_since
        return self.stepped + running


class SimTrainer(Trainer):
    """A trainer whose step costs virtual time (see module docstring).

    Args:
        pool: the GPUs it trains on.
        costs: the training cost model.
        token_scale: real tokens per simulated token.
    """

    def __init__(self, pool: TrainPool, costs: TrainCosts, token_scale: int = 1):
        self.pool, self.costs, self.token_scale = pool, costs, token_scale
        self.version = 0

    async def step(self, batch: Batch) -> dict[str, float]:
        """One step: wait for the pool, sleep the step's cost, version += 1."""
        tokens = int(batch.attention_mask_B_T.sum()) * self.token_scale
        seconds = self.costs.step_seconds(tokens, self.pool.gpus)
        async with self.pool.lock:
            self.pool.stepping_since = anyio.current_time()
            try:
                await anyio.sleep(seconds)
            finally:
                self.pool.stepping_since = None
            self.pool.gpu_seconds += seconds * self.pool.gpus
            self.pool.stepped += seconds
        self.version += 1
        return {"loss": 0.0, "grad_norm": 0.0, "tokens": float(batch.num_tokens * self.token_scale),
                "train_tokens": float(tokens), "train_seconds": seconds}

    def weights(self) -> dict:
        return {}


class SimPublisher(Publisher):
    """Publishing is the simulated engine's in-flight update (`contracts.Publisher`).

    Args:
        engine: the policy's simulated engine.
        trainer: the policy's trainer (whose version the engine is brought to).
    """

    where = "simulated GPUs"
    checksum = None

    def __init__(self, engine: SimEngine, trainer: Trainer):
        self.engine, self.trainer = engine, trainer

    async def publish(self) -> dict[str, Any]:
        start = anyio.current_time()
        await self.engine.apply_weights(self.trainer.version)
        return {"transfer_kind": "simulated", "transfer_seconds": anyio.current_time() - start}


class SimTokenizer:
    """Just enough tokenizer for the dataflow: pad and EOS ids (prompts are token ids)."""

    pad_token_id = 0
    eos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [2] * max(1, len(text.split()))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


def sim_policy(name: str, engine: SimEngine, trainer: SimTrainer, algorithm=None) -> Policy:
    """A Policy over the simulated `engine` and `trainer` (GRPO without group filtering by
    default)."""
    return Policy(name, ModelSpec(f"sim-{name}"), algorithm or GRPO(filter_groups=False),
                  AdamWConfig(), engine, trainer, SimPublisher(engine, trainer), SimTokenizer())
