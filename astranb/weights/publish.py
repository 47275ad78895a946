"""Getting a trainer's weights to whatever samples from them.

`deliver` is the one place a weight transfer heals itself: the receiver is sent what brings it up
to date from the version and checksum it holds (a delta when its base matches), and if it rejects
that payload (wrong base, corrupt bytes) it gets a full snapshot instead. The in-process publisher
below, the rollout pool (pushing to services) and a rollout service (pulling from a trainer
service) all use it.

Publishers satisfy `astranb.contracts.Publisher`:

    EnginePublisher   an engine in this process, through a versioned WeightStore (bf16 deltas)
    StatePublisher    an engine in this process, by copying the trainer's tensors (no codec)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio

from ..contracts import Engine, Publisher, Trainer
from ..types import WeightUpdate
from .codec import WeightTransferError
from .store import PublishStats, WeightStore

__all__ = ["deliver", "apply_to_engine", "transfer_metrics", "EnginePublisher", "StatePublisher"]

R = TypeVar("R")
P = TypeVar("P")  # what fetch returns and apply takes: a payload, or one with work done on it


async def deliver(
    fetch: Callable[[bool], Awaitable[P]],
    apply: Callable[[P], Awaitable[R]],
    *,
    rejected: Callable[[BaseException], bool] = lambda e: isinstance(e, WeightTransferError),
) -> tuple[P, R, str]:
    """Send a receiver the payload that brings it up to date; heal a rejected one with a full one.

    Args:
        fetch: `fetch(full)` returns the payload: with full=False whatever fits the receiver's
            base (a delta when it matches), with full=True a full snapshot.
        apply: hands a payload to the receiver and returns its answer.
        rejected: which errors of `apply` mean "send a full snapshot instead" (by default the
            codec's WeightTransferError); anything else propagates.

    Returns:
        (the payload that was applied, the receiver's answer, why a full snapshot had to
        follow: the rejection's message, or "" when the first payload was taken).
    """
    payload = await fetch(False)
    try:
        return payload, await apply(payload), ""
    except Exception as error:
        if not rejected(error):
            raise
        reason = str(error)
    payload = await fetch(True)
    return payload, await apply(payload), reason


async def apply_to_engine(engine: Any, name: str, version: int, payload: bytes) -> dict[str, Any]:
    """Hand a payload to an engine in this process; its answer ({"kind", "apply_seconds"})."""
    update = WeightUpdate(name, version, payload=payload)
    return dict(await asyncio.wrap_future(engine.update_weights(update)))


def transfer_metrics(payload: bytes, applied: Mapping[str, Any], fallback: str,
                     stats: PublishStats, checksum: int | None) -> dict[str, Any]:
    """The metrics row's columns for one version published to an engine in this process."""
    return {
        "transfer_kind": applied["kind"],
        "transfer_bytes": len(payload),
        "transfer_ratio": len(payload) / max(stats.full_bytes, 1),
        "changed_fraction": stats.changed_fraction,
        "encode_seconds": stats.encode_seconds,
        "decode_seconds": applied["apply_seconds"],
        "transfer_fallback": fallback,
        "weights_checksum": checksum,
    }


class EnginePublisher(Publisher):
    """Publishes through a WeightStore to an engine in this process (deltas in bf16).

    Args:
        name: the policy's name.
        engine: the policy's engine.
        trainer: the policy's trainer.
        store: the versioned store the trainer's weights are encoded into.
        verify: recompute the engine's checksum after every publish (tests; slow on big models).
    """

    where = "this process"

    def __init__(self, name: str, engine: Any, trainer: Trainer, store: WeightStore, *,
                 verify: bool = False):
        self.name, self.engine, self.trainer = name, engine, trainer
        self.store, self.verify = store, verify

    @property
    def checksum(self) -> int | None:
        return self.store.checksum

    def publish_initial(self) -> None:
        """Version 0 as a full snapshot, so the engine samples from exactly the published (bf16)
        weights from the first token on (blocking: called while building the policy)."""
        trainer = self.trainer
        self.store.publish(trainer.version, trainer.weights())
        update = WeightUpdate(self.name, trainer.version, payload=self.store.pull_full())
        self.engine.update_weights(update).result()

    async def publish(self) -> dict[str, Any]:
        name, trainer = self.name, self.trainer
        version = trainer.version
        # copying and encoding weights is heavy: keep it off the event loop
        stats = await anyio.to_thread.run_sync(
            lambda: self.store.publish(version, trainer.weights()))
        engine = self.engine

        async def fetch(full: bool) -> bytes:
            if full:
                return self.store.pull_full()
            return self.store.pull(engine.version, engine.weights_checksum)

        async def apply(payload: bytes) -> dict[str, Any]:
            return await apply_to_engine(engine, name, version, payload)

        payload, applied, fallback = await deliver(fetch, apply)
        metrics = transfer_metrics(payload, applied, fallback, stats, self.store.checksum)
        if self.verify:
            metrics["engine_checksum"] = await anyio.to_thread.run_sync(engine.published_checksum)
        return metrics


class StatePublisher(Publisher):
    """Copies the trainer's full-precision tensors into an engine in this process (no codec,
    no checksum: `weight_transfer="state"`). `publish_initial` has nothing to do: the engine was
    built from the same spec as the trainer.

    Args:
        name: the policy's name.
        engine: the policy's engine.
        trainer: the policy's trainer.
    """

    where = "this process"
    checksum = None

    def __init__(self, name: str, engine: Engine, trainer: Trainer):
        self.name, self.engine, self.trainer = name, engine, trainer

    async def publish(self) -> dict[str, Any]:
        trainer = self.trainer
        state = await anyio.to_thread.run_sync(trainer.weights)
        update = WeightUpdate(self.name, trainer.version, dict(state))
        await asyncio.wrap_future(self.engine.update_weights(update))
        return {"transfer_kind": "state"}
