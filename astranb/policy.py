"""A policy: one model being trained, with the engine that samples from it and its trainer.

`session.policy(...)` builds one; users rarely construct it directly. The engine and the trainer
each hold their own copy of the model, built from the same spec so they start bit-identical; after
every train step the trainer publishes its weights to the engine as version v+1.
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass, field

from .algorithms import Algorithm
from .engines.base import RolloutEngine
from .models import ModelSpec
from .training.local import AdamW, LocalTrainer
from .types import WeightUpdate

__all__ = ["Policy"]


@dataclass(eq=False)
class Policy:
    """One trainable policy.

    Attributes:
        name: unique within the session; used in metrics and wiring.
        spec: how the model and tokenizer are built.
        algorithm: advantage and loss rule (GRPO, M2PO).
        optimizer: AdamW settings.
        engine: the rollout engine sampling from the current weights.
        trainer: the trainer updating them.
    """

    name: str
    spec: ModelSpec
    algorithm: Algorithm
    optimizer: AdamW
    engine: RolloutEngine
    trainer: LocalTrainer
    tokenizer: object = field(repr=False)

    @property
    def version(self) -> int:
        """Weights version: the number of train steps taken."""
        return self.trainer.version

    async def publish(self) -> WeightUpdate:
        """Send the trainer's current weights to the engine; returns once the engine uses them."""
        update = WeightUpdate(self.name, self.trainer.version, self.trainer.weights())
        await asyncio.wrap_future(self.engine.update_weights(update))
        return update

    def __repr__(self) -> str:
        return (
            f"Policy({self.name!r}, model={self.spec.name}, algorithm={self.algorithm.name}, "
            f"version={self.version})"
        )
