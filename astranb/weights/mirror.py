"""A receiver's copy of the published weights, updated by payloads (engines share this)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _kernels
from ._sections import _COMPILED_WORK, _bits
from .codec import BaseMismatch, CorruptPayload, Header, _apply, _decode, _open, checksum
from .incoming import Prepared

__all__ = ["Mirror"]

_WARM_ELEMENTS = 4 * _COMPILED_WORK  # a model whose deltas will likely go through _kernels


class Mirror:
    """The weights exactly as last published (bf16 by default) and their checksum."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.checksum: int | None = None

    def apply(
        self,
        payload: bytes | bytearray,
        *,
        policy: str | None = None,
        version: int | None = None,
        prepared: Prepared | None = None,
    ) -> Header:
        """Bring the mirror to the payload's version: a full snapshot replaces it, a delta is
        applied in place against the current checksum.

        Args:
            payload: a full snapshot or a delta (astranb.weights.codec).
            policy, version: when given, the payload must be for this policy and make this
                version (checked before anything changes).
            prepared: the hash and the sections an `Incoming` worked out while the payload
                arrived (used only when it watched this very buffer).

        Raises:
            ValueError: the payload is for another policy or version.
            BaseMismatch: a delta while the mirror holds no (or other) weights.
            CorruptPayload: the payload or the result failed its hash; the mirror is then marked
                unknown (it may be half written) and only a full snapshot heals it.
        """
        if prepared is not None and prepared.payload is not payload:
            prepared = None
        # the one hash of the payload (or its digest, taken as it arrived) before anything changes
        header, body = _open(payload, digest=None if prepared is None else prepared.digest)
        if policy is not None and header.policy != policy:
            raise ValueError(
                f"payload is for policy {header.policy!r}, this engine serves {policy!r}"
            )
        if version is not None and header.version != version:
            raise ValueError(f"payload makes version {header.version}, update says {version}")
        if header.kind == "full":
            self.tensors, self.checksum = _decode(None, header, body), header.checksum
            if header.elements >= _WARM_ELEMENTS:  # deltas big enough for the compiled loops
                _kernels.warm({_bits(t).dtype for t in self.tensors.values()})
            return header
        if self.tensors is None:
            raise BaseMismatch(
                "the engine holds no published weights yet; send a full snapshot first"
            )
        try:
            _apply(self.tensors, header, body, base_checksum=self.checksum,
                   ready=None if prepared is None else prepared.ready)
        except CorruptPayload:
            self.checksum = None
            raise
        self.checksum = header.checksum
        return header

    def set(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> None:
        """Hold plain tensors (a `state` update) in the published dtype."""
        self.tensors = {k: v.detach().to("cpu", dtype, copy=True) for k, v in state.items()}
        self.checksum = checksum(self.tensors)

    def clear(self) -> None:
        self.tensors = self.checksum = None
