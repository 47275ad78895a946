"""The weight codec's errors (astranb.weights.codec raises them; the store answers them with a
full snapshot)."""

from __future__ import annotations

from ..errors import AstranbError

__all__ = ["WeightTransferError", "CorruptPayload", "BaseMismatch"]


class WeightTransferError(AstranbError, ValueError):
    """A payload cannot be applied; nothing was changed unless the message says otherwise."""


class CorruptPayload(WeightTransferError):
    """Truncated, altered or not an astranb weight payload."""


class BaseMismatch(WeightTransferError):
    """A delta made against other weights than the receiver holds."""
