"""The interface every rollout engine offers to the rest of astranb.

An engine turns `GenerationRequest`s into `Generation`s (tokens, logprobs under the sampling
distribution, and the weight version of each token) and accepts weight updates while it runs.
`HFEngine` is the pure-torch implementation; other backends (e.g. SGLang) implement the same shape.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Protocol, runtime_checkable

from ..types import Generation, GenerationRequest, WeightUpdate

__all__ = ["RolloutEngine", "settle"]


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
class RolloutEngine(Protocol):
    """What the dataflow layer needs from a rollout engine."""

    name: str
    """Policy name the engine serves."""

    @property
    def version(self) -> int:
        """Weight version the next sampled token will carry."""
        ...

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request from any thread; the Future resolves to a Generation."""
        ...

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generate one completion; cancelling the awaiting task drops the request."""
        ...

    def update_weights(self, update: WeightUpdate) -> Future:
        """Queue new weights, applied between decode steps; the Future resolves once applied."""
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

    def close(self) -> None:
        """Stop the engine and release its resources (idempotent)."""
        ...
