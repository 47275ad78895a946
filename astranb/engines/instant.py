"""InstantEngine: answers at once with made-up tokens, for measuring everything but the model.

Benchmarks of the service path (HTTP, scheduling, accounting) and fast service tests need an
engine whose cost is ~0, so what they time is astranb's own machinery. It samples tokens from a
seeded generator, gives every token logprob log(1/vocab) and the current version, and applies
weight payloads to a bf16 mirror exactly as HFEngine does, so weight transfer is real.
"""

from __future__ import annotations

import math
import random
import threading
from concurrent.futures import Future

from .. import weights
from ..types import Generation, GenerationRequest, WeightUpdate
from .base import MirroredWeights, RolloutEngine

__all__ = ["InstantEngine"]


class InstantEngine(MirroredWeights, RolloutEngine):
    """A RolloutEngine with no model (see module docstring).

    Args:
        name: policy name.
        vocab_size: token ids are drawn from [3, vocab_size).
        seed: seed of the token generator.
        capacity: what availability() reports.
        tokenizer: optional tokenizer (EpisodeContext uses it for text prompts and EOS).
    """

    def __init__(self, name: str = "policy", *, vocab_size: int = 59, seed: int = 0,
                 capacity: int = 1024, tokenizer=None):
        self.name, self.vocab_size, self.capacity = name, vocab_size, capacity
        self.tokenizer = tokenizer
        self._rng = random.Random(seed)
        self._version = 0
        self._mirror = weights.Mirror()
        self._lock = threading.Lock()
        self._paused = False

    @property
    def version(self) -> int:
        return self._version

    def published_checksum(self) -> int:
        if self._mirror.tensors is None:
            raise LookupError("no published weights were applied to this engine")
        return weights.checksum(self._mirror.tensors)

    def submit(self, request: GenerationRequest) -> Future:
        future: Future = Future()
        future.set_result(self._answer(request))
        return future

    async def generate(self, request: GenerationRequest) -> Generation:
        return self._answer(request)

    def _answer(self, request: GenerationRequest) -> Generation:
        n = request.sampling.max_new_tokens
        with self._lock:
            ids = tuple(self._rng.randrange(3, self.vocab_size) for _ in range(n))
            version = self._version
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        return Generation(request.prompt_ids, ids, (-math.log(self.vocab_size),) * n,
                          (version,) * n, "length", text)

    def update_weights(self, update: WeightUpdate) -> Future:
        future: Future = Future()
        try:
            kind = self._apply(update)
        except Exception as error:
            future.set_exception(error)
        else:
            future.set_result({"kind": kind, "apply_seconds": 0.0})
        return future

    def _apply(self, update: WeightUpdate) -> str:
        with self._lock:
            if update.payload is None:
                self._mirror.set(update.state)
                kind = "state"
            else:
                applied = self._mirror.apply(update.payload, policy=self.name,
                                             version=update.version, prepared=update.prepared)
                kind = applied.kind
            self._version = update.version
        return kind

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def availability(self) -> int:
        return 0 if self._paused else self.capacity

    def close(self) -> None:
        pass
