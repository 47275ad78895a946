"""A policy: one model being trained, with the engine that samples from it and its trainer.

`session.policy(...)` builds one; users rarely construct it directly. The engine and the trainer
each hold their own copy of the model, built from the same spec so they start bit-identical; after
every train step the trainer publishes its weights to the engine as version v+1.
"""

from __future__ import annotations

import asyncio
import inspect

import anyio

from dataclasses import dataclass, field

from .algorithms import Algorithm
from .engines.base import RolloutEngine
from .models import ModelSpec
from .services.pool import RolloutPool
from .services.remote_trainer import RemoteTrainer
from .training.local import AdamW, LocalTrainer
from .types import Batch, WeightUpdate
from .weights import WeightTransferError
from .weights.store import WeightStore

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
        store: the weight store between them.
    """

    name: str
    spec: ModelSpec
    algorithm: Algorithm
    optimizer: AdamW
    engine: RolloutEngine | None
    """The engine in this process (None when rollout services sample for the policy)."""
    trainer: LocalTrainer | RemoteTrainer
    tokenizer: object = field(repr=False)
    store: WeightStore | None = None
    """Versioned weight store the trainer publishes through (None: plain state copies)."""
    pool: RolloutPool | None = None
    """Rollout services that sample for the policy (None: `engine` in this process)."""
    max_batch_size: int = 64
    """Most sequences an engine decodes at once."""
    seed: int = 0
    """Sampling seed of the engine(s)."""
    verify_weights: bool = False
    """Recompute the engine's weight checksum after every publish (tests; slow on big models)."""

    @property
    def version(self) -> int:
        """Weights version: the number of train steps taken."""
        return self.trainer.version

    @property
    def weights_checksum(self) -> int | None:
        """Checksum of the latest published weights (None before the first publish)."""
        if isinstance(self.trainer, RemoteTrainer):
            return self.trainer.checksum
        return self.store.checksum if self.store is not None else None

    async def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step, off the event loop: awaited when the trainer's step is async (a
        trainer service, a simulated trainer), else in a worker thread."""
        if inspect.iscoroutinefunction(self.trainer.step):
            return await self.trainer.step(batch)
        return await anyio.to_thread.run_sync(self.trainer.step, batch)

    async def publish(self) -> dict[str, float | str]:
        """Send the trainer's current weights to the engine; returns once the engine uses them.

        With a weight store (the default) the weights travel as a payload: a delta against the
        engine's version when it holds the previous one, else a full snapshot; a delta that
        fails to apply (wrong base, corruption) is healed by a full snapshot. Returns transfer
        metrics for the run's metrics row.
        """
        version = self.trainer.version
        if self.pool is not None:
            return await self._publish_to_services(version)
        # copying and encoding weights is heavy: keep it off the event loop
        if self.store is None:
            state = await anyio.to_thread.run_sync(self.trainer.weights)
            await asyncio.wrap_future(self.engine.update_weights(WeightUpdate(self.name, version, state)))
            return {"transfer_kind": "state"}
        stats = await anyio.to_thread.run_sync(
            lambda: self.store.publish(version, self.trainer.weights())
        )
        payload = self.store.pull(self.engine.version, self.engine.weights_checksum)
        fallback = ""
        try:
            applied = await self._send(payload, version)
        except WeightTransferError as error:
            fallback = str(error)
            payload = self.store.pull_full()
            applied = await self._send(payload, version)
        metrics = {
            "transfer_kind": applied["kind"],
            "transfer_bytes": len(payload),
            "transfer_ratio": len(payload) / stats.full_bytes,
            "changed_fraction": stats.changed_fraction,
            "encode_seconds": stats.encode_seconds,
            "decode_seconds": applied["apply_seconds"],
            "transfer_fallback": fallback,
            "weights_checksum": self.store.checksum,
        }
        if self.verify_weights:
            metrics["engine_checksum"] = await anyio.to_thread.run_sync(self.engine.published_checksum)
        return metrics

    async def _publish_to_services(self, version: int) -> dict[str, float | str]:
        """Rollout services pull from the trainer service, or get this process's store payload."""
        metrics: dict[str, float | str] = {}
        if not isinstance(self.trainer, RemoteTrainer):
            stats = await anyio.to_thread.run_sync(
                lambda: self.store.publish(version, self.trainer.weights())
            )
            metrics = {"changed_fraction": stats.changed_fraction,
                       "encode_seconds": stats.encode_seconds}
        metrics.update(await self.pool.publish(self))
        metrics["weights_checksum"] = self.weights_checksum
        return metrics

    async def _send(self, payload: bytes, version: int) -> dict:
        update = WeightUpdate(self.name, version, payload=payload)
        return await asyncio.wrap_future(self.engine.update_weights(update))

    def __repr__(self) -> str:
        return (
            f"Policy({self.name!r}, model={self.spec.name}, algorithm={self.algorithm.name}, "
            f"version={self.version}{', remote' if self.pool is not None else ''})"
        )

    def describe(self) -> dict[str, object]:
        """What the policy is and where it runs, as plain values (the notebook display's rows)."""
        checksum = self.weights_checksum
        return {
            "model": self.spec.name + (f" ({self.spec.path})" if self.spec.path else ""),
            "algorithm": repr(self.algorithm),
            "optimizer": repr(self.optimizer),
            "rollouts": (f"{len(self.pool.members)} rollout service(s)" if self.pool is not None
                         else type(self.engine).__name__),
            "trainer": type(self.trainer).__name__,
            "version": self.version,
            "weights checksum": f"{checksum:016x}" if isinstance(checksum, int) else "not published",
        }

    def _repr_html_(self) -> str:
        from ._html import card, table

        where = "rollout services" if self.pool is not None else "this process"
        rows = list(self.describe().items())
        return card(f"Policy {self.name!r}", f"version {self.version}, rollouts in {where}",
                    table(("", ""), rows), "astranb-policy")
