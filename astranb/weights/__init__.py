"""Weight payloads (bit-exact full snapshots and sparse deltas) and the versioned store."""

from .codec import (
    BaseMismatch,
    CorruptPayload,
    Header,
    WeightTransferError,
    apply,
    checksum,
    decode,
    dtype_named,
    encode,
    encode_full,
    peek,
)
from .incoming import Incoming, Prepared
from .mirror import Mirror

__all__ = [
    "BaseMismatch",
    "CorruptPayload",
    "Header",
    "Incoming",
    "Mirror",
    "Prepared",
    "WeightTransferError",
    "apply",
    "checksum",
    "decode",
    "dtype_named",
    "encode",
    "encode_full",
    "peek",
]
