"""A policy's versioned weight store: what the trainer publishes, what receivers pull.

The trainer publishes every version's weights (in the dtype engines run: bf16 by default). The
store keeps the latest weights and, for version v, a delta against v-1; every `full_every`
versions it makes receivers resync from a full snapshot instead (as AstraFlow's
`delta_full_sync_interval`), so a receiver can never drift for long. A receiver asks with the
version and checksum it holds: exactly the previous version gets the delta; anything else (older,
unknown, or the same version number with other weights) gets a full snapshot. The in-process path
and the HTTP pull path hand out the same bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .codec import Header, changed_fraction, checksum, encode, encode_full, layout_mismatch, peek

__all__ = ["WeightStore", "PublishStats"]


@dataclass(frozen=True)
class PublishStats:
    """What publishing one version cost and found."""

    version: int
    """Published version."""
    changed_fraction: float
    """Fraction of elements whose bits changed since the previous version (1.0 for the first)."""
    delta_bytes: int
    """Size of the delta payload (0 when no delta was made)."""
    full_bytes: int
    """Size of the weights themselves (a raw full copy)."""
    encode_seconds: float
    """Time spent encoding the delta (and hashing)."""


class WeightStore:
    """Latest published weights of one policy, with the delta from the version before.

    Args:
        policy: policy name (written into every payload).
        full_every: every this many versions receivers get a full snapshot (0: never forced).
        dtype: dtype weights are published in.
    """

    def __init__(self, policy: str, *, full_every: int = 10, dtype: torch.dtype = torch.bfloat16,
                 deltas: bool = True):
        if full_every < 0:
            raise ValueError(
                f"full_every must be >= 0 (0 never forces a full sync), got {full_every}"
            )
        self.policy = policy
        self.full_every = full_every
        self.dtype = dtype
        self.deltas = deltas
        """False: receivers always get full snapshots and no delta is encoded (a receiver on the
        same machine: copying 2 bytes per weight costs less than finding the changed ones)."""
        self._lock = threading.Lock()
        self._weights: dict[str, torch.Tensor] | None = None
        self._version = -1
        self._checksum: int | None = None
        self._delta: bytes | None = None
        self._delta_header: Header | None = None
        self._full: bytes | None = None

    @property
    def version(self) -> int:
        """Latest published version (-1 before the first publish)."""
        return self._version

    @property
    def checksum(self) -> int | None:
        """checksum() of the latest published weights."""
        return self._checksum

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> PublishStats:
        """Record `weights` as `version` (converted to the store's dtype, copied)."""
        new = {k: v.detach().to("cpu", self.dtype, copy=True).contiguous()
               for k, v in weights.items()}
        start = time.perf_counter()
        with self._lock:
            old, old_version = self._weights, self._version
            delta = None
            # made even when a full sync is due: it measures the changed fraction for the metrics
            comparable = old if old is not None and not layout_mismatch(old, new) else None
            if comparable is not None and self.deltas and version == old_version + 1:
                delta = encode(comparable, new, policy=self.policy, base_version=old_version,
                               version=version, base_checksum=self._checksum)
            header = peek(delta) if delta else None
            changed = (header.changed / max(header.elements, 1) if header
                       else changed_fraction(comparable, new) if comparable is not None
                       else 1.0)
            self._weights, self._version, self._full = new, version, None
            self._delta, self._delta_header = delta, header
            self._checksum = header.checksum if header else checksum(new)
        seconds = time.perf_counter() - start
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        return PublishStats(version, changed, len(delta) if delta else 0, full_bytes, seconds)

    def pull(self, have_version: int | None = None, have_checksum: int | None = None) -> bytes:
        """The payload that brings a receiver holding (version, checksum) to the latest version."""
        with self._lock:
            if self._weights is None:
                raise LookupError(f"nothing published yet for policy {self.policy!r}")
            header = self._delta_header  # set together with _delta: None exactly when it is
            if self._delta is not None and header is not None and not self._full_sync_due():
                if have_version == header.base_version and have_checksum == header.base_checksum:
                    return self._delta
            if self._full is None:
                self._full = encode_full(self._weights, policy=self.policy, version=self._version)
            return self._full

    def pull_full(self) -> bytes:
        """A full snapshot of the latest version (what a failed delta is healed with)."""
        return self.pull(None, None)

    def _full_sync_due(self) -> bool:
        return self.full_every > 0 and self._version % self.full_every == 0
