"""The interface every rollout engine offers to the rest of astranb.

An engine turns `GenerationRequest`s into `Generation`s (tokens, logprobs under the sampling
distribution, and the weight version of each token) and accepts weight updates while it runs.
`HFEngine` is the pure-torch implementation; other backends (e.g. SGLang) implement the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Protocol, runtime_checkable

import torch

from ..contracts import Engine
from ..types import Generation, GenerationRequest
from ..weights import Mirror

__all__ = ["MirroredWeights", "RolloutEngine", "settle"]


class MirroredWeights:
    """What an engine that keeps its published weights in a `weights.Mirror` (`self._mirror`)
    says about them (the engines share this)."""

    _mirror: Mirror

    @property
    def weights_checksum(self) -> int | None:
        """Checksum of the weights as last published to this engine (None if none was)."""
        return self._mirror.checksum

    def published_weights(self) -> Mapping[str, torch.Tensor] | None:
        """The weights exactly as last published (the payloads' names and dtype; None if
        none were): what a relay encodes a full snapshot from. Do not modify them."""
        return self._mirror.tensors


def settle(future: Future, *, result=None, exc: BaseException | None = None) -> None:
    """Resolve a future unless its caller already cancelled it (engines share this)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile: nobody is waiting
        pass


@runtime_checkable
class RolloutEngine(Engine, Protocol):
    """Everything an engine implementation offers: `contracts.Engine` (what the dataflow uses:
    generate, update_weights, version, weights_checksum, close) plus what the rollout service
    drives directly (submit from any thread, pause/resume, availability, and the published
    weights a relay serves)."""

    def submit(self, request: GenerationRequest) -> Future[Generation]:
        """Queue a request from any thread; the Future resolves to a Generation."""
        ...

    def pause(self) -> None:
        """Stop starting decode steps (queued requests wait)."""
        ...

    def resume(self) -> None:
        """Undo pause()."""
        ...

    def availability(self) -> int:
        """Requests that could start decoding right now (0 while paused or updating)."""
        ...

    def published_weights(self) -> Mapping[str, torch.Tensor] | None:
        """The weights exactly as last published (None if none were, or the engine keeps no
        copy): what a rollout service relaying to its region encodes a full snapshot from."""
        ...
