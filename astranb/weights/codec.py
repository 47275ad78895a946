"""Bit-exact weight payloads: full snapshots and sparse deltas, in one self-checking frame.

Between two RL steps only a small fraction of bf16 weights change (an update below half an ulp
rounds away). A delta finds them by comparing raw bits, then stores, per tensor, whichever is
smallest of:

- "rice": positions as gaps coded with a Rice code (quotients in unary, remainders in k bits,
  two separate bit streams so both decode with whole-array numpy ops). For independently placed
  changes the gaps are geometric, and a Rice code is within a few percent of their entropy.
- "bitmap": positions as a packed bit per element, zstd-compressed (dense changes).
- "dense": no positions; every element's value (most of the tensor changed).

Values are the difference of the new and old bit patterns (a few ulps move a float's bits by a
few units), zig-zag mapped, split into byte planes and zstd-compressed; or the raw new bits when
those compress better (random bit patterns). Nothing is rounded: decoding gives the new tensors
bit for bit, whatever the dtype (bf16, fp16, fp32, ints: any itemsize of 1, 2, 4 or 8 bytes).

Frame: a fixed prefix (magic, format, kind, total length, header length), a zstd-compressed JSON
header (policy, base and target version, checksums of the base and the result, the tensor table),
the sections, and an xxh3 hash of everything before it. A truncated or corrupted payload fails
the hash before anything is decoded; a payload for other base weights fails the base check; and
the result is hashed again after decoding. Any of these raises a `WeightTransferError` that says
what happened; the store answers it with a full snapshot.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ._sections import (
    _UINT,
    Inflated,
    _apply_sections,
    _bits,
    _encode_tensor,
    _entry,
    _unzstd,
    _zstd,
)
from .errors import BaseMismatch, CorruptPayload, WeightTransferError

__all__ = [
    "WeightTransferError",
    "CorruptPayload",
    "BaseMismatch",
    "Header",
    "encode",
    "encode_full",
    "changed_fraction",
    "decode",
    "apply",
    "peek",
    "checksum",
    "dtype_named",
    "layout_mismatch",
]

MAGIC = b"ANBW"
FORMAT = 1
KIND_FULL, KIND_DELTA = 0, 1
_PREFIX = struct.Struct("<4sHBxQI")  # magic, format, kind, total length, header length
_TRAILER = struct.Struct("<Q")  # xxh3_64 of everything before it
_MAX_HEADER = 256 << 20
_SCHEMES = ("same", "raw", "dense", "rice", "bitmap")

@dataclass(frozen=True)
class Header:
    """What a payload says about itself."""

    kind: str
    """"full" or "delta"."""
    policy: str
    """Policy the weights belong to."""
    base_version: int | None
    """Version the delta applies to (None for a full snapshot)."""
    version: int
    """Version of the weights the payload produces."""
    base_checksum: int | None
    """checksum() of the base weights (None for a full snapshot)."""
    checksum: int
    """checksum() of the resulting weights."""
    tensors: list[dict[str, Any]] = field(repr=False)
    """Per tensor: name, dtype, shape, scheme, changed count, section sizes."""
    total_bytes: int = 0
    """Payload size."""

    @property
    def changed(self) -> int:
        return sum(t["changed"] for t in self.tensors)

    @property
    def elements(self) -> int:
        return sum(int(np.prod(t["shape"], dtype=np.int64)) for t in self.tensors)

    @property
    def model_bytes(self) -> int:
        """Size of the weights themselves (what a raw full copy costs)."""
        return sum(int(np.prod(t["shape"], dtype=np.int64)) * t["itemsize"] for t in self.tensors)

    def section_bytes(self, which: str) -> int:
        """Bytes spent on "positions" or "values" over all tensors."""
        return sum(t[which] for t in self.tensors)


# -- public API ------------------------------------------------------------------------------------
def checksum(tensors: Mapping[str, torch.Tensor]) -> int:
    """xxh3-64 over names, dtypes, shapes and raw bytes, in name order."""
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(_bits(t).data)
    return h.intdigest()


def encode_full(new: Mapping[str, torch.Tensor], *, policy: str = "", version: int = 0) -> bytes:
    """A full snapshot of `new`, framed like a delta."""
    entries, sections = [], []
    for name in sorted(new):
        bits = _bits(new[name])
        entries.append(_entry(name, new[name], "raw", bits.size, positions=0, values=bits.nbytes))
        sections.append(bits.tobytes())
    meta = {"policy": policy, "base_version": None, "version": version,
            "base_checksum": None, "checksum": checksum(new)}
    return _frame(KIND_FULL, meta, entries, sections)


def encode(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    policy: str = "",
    base_version: int = 0,
    version: int | None = None,
    base_checksum: int | None = None,
) -> bytes:
    """A delta turning `old` into `new` (same names, shapes and dtypes), bit for bit.

    `base_checksum` is checksum(old) when the caller has it cached (saves one pass).
    """
    _check_same_layout(old, new)
    entries, sections = [], []
    for name in sorted(new):
        entry, parts = _encode_tensor(name, _bits(old[name]), _bits(new[name]), new[name])
        entries.append(entry)
        sections.extend(parts)
    meta = {"policy": policy, "base_version": base_version,
            "version": base_version + 1 if version is None else version,
            "base_checksum": checksum(old) if base_checksum is None else base_checksum,
            "checksum": checksum(new)}
    return _frame(KIND_DELTA, meta, entries, sections)


def peek(payload: bytes | bytearray, *, verify: bool = True) -> Header:
    """Check the frame and read its header (no tensor is decoded).

    verify=False skips hashing the whole payload: for routing a payload to a receiver that
    decodes it (decode and apply always check the hash before anything is written).
    """
    header, _ = _open(payload, verify=verify)
    return header


def decode(
    old: Mapping[str, torch.Tensor] | None, payload: bytes | bytearray
) -> dict[str, torch.Tensor]:
    """New tensors from `old` and a payload (old may be None for a full snapshot)."""
    return _decode(old, *_open(payload))


def _decode(
    old: Mapping[str, torch.Tensor] | None, header: Header, body: memoryview
) -> dict[str, torch.Tensor]:
    """decode() of a payload `_open` has checked (the receiver's one hash of it)."""
    if header.kind == "delta":
        if old is None:
            raise BaseMismatch("a delta needs the base weights; pass them or send a full snapshot")
        _check_base(header, checksum(old))
        # contiguous copies: a transposed `old` would otherwise clone with its strides, and
        # writing into it in place needs contiguous memory
        out = {name: t.detach().clone(memory_format=torch.contiguous_format)
               for name, t in old.items()}
    else:
        out = {e["name"]: torch.empty(e["shape"], dtype=dtype_named(e["dtype"]))
               for e in header.tensors}
    _apply_sections(header.tensors, body, out)
    _check_result(header, out)
    return out


def apply(
    tensors: Mapping[str, torch.Tensor],
    payload: bytes | bytearray,
    *,
    base_checksum: int | None = None,
) -> Header:
    """Apply a payload in place to `tensors` (CPU, contiguous).

    Args:
        tensors: the receiver's weights; same names, shapes and dtypes as the payload's.
        payload: a full snapshot or a delta.
        base_checksum: the receiver's cached checksum(tensors), to skip hashing them again.

    Raises:
        CorruptPayload: truncated or altered (checked before anything is written), or the result
            does not hash to the header's checksum (the tensors then hold wrong weights: apply a
            full snapshot).
        BaseMismatch: a delta for other base weights (nothing written).
    """
    return _apply(tensors, *_open(payload), base_checksum=base_checksum)


def _apply(
    tensors: Mapping[str, torch.Tensor],
    header: Header,
    body: memoryview,
    *,
    base_checksum: int | None = None,
    ready: Mapping[int, Inflated] | None = None,
) -> Header:
    """apply() of a payload `_open` has checked (the receiver's one hash of it); `ready` are
    sections inflated while it arrived (weights.incoming)."""
    _check_layout(header, tensors)
    if header.kind == "delta":
        _check_base(header, checksum(tensors) if base_checksum is None else base_checksum)
    _apply_sections(header.tensors, body, tensors, ready)
    _check_result(header, tensors)
    return header


# -- frame -----------------------------------------------------------------------------------------
def _frame(
    kind: int, meta: dict[str, Any], entries: list[dict[str, Any]], sections: list[bytes]
) -> bytes:
    for entry in entries:
        entry.setdefault(
            "sections", [entry["positions"] + entry["values"]] if entry["values"] else []
        )
    header = _zstd(json.dumps({**meta, "tensors": entries}).encode())
    body_len = sum(map(len, sections))
    total = _PREFIX.size + len(header) + body_len + _TRAILER.size
    h = xxhash.xxh3_64()
    parts = [_PREFIX.pack(MAGIC, FORMAT, kind, total, len(header)), header, *sections]
    for p in parts:
        h.update(p)
    return b"".join([*parts, _TRAILER.pack(h.intdigest())])


def _open(
    payload: bytes | bytearray, *, verify: bool = True, digest: int | None = None
) -> tuple[Header, memoryview]:
    """The checked header and the body of a payload. `digest`: the xxh3 of everything before
    the trailer, when the receiver took it as the bytes arrived (weights.incoming)."""
    view = memoryview(payload)
    total, header_len = _read_prefix(view)
    if len(view) != total:
        raise CorruptPayload(f"payload truncated or padded: {len(view)} bytes, header says {total}")
    (expected,) = _TRAILER.unpack_from(view, total - _TRAILER.size)
    if verify:
        if digest is None:
            digest = xxhash.xxh3_64_intdigest(view[: total - _TRAILER.size])
        if digest != expected:
            raise CorruptPayload("payload hash mismatch: the bytes were altered in transit")
    return _read_header(view, header_len), view[_PREFIX.size + header_len : total - _TRAILER.size]


def _read_prefix(view: memoryview) -> tuple[int, int]:
    """(total length, header length) from the prefix, which must be there."""
    if len(view) < _PREFIX.size + _TRAILER.size:
        raise CorruptPayload(f"payload of {len(view)} bytes is too short to be a weight payload")
    magic, fmt, kind, total, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPayload(f"not an astranb weight payload (magic {bytes(magic)!r})")
    if fmt != FORMAT:
        raise CorruptPayload(f"payload format {fmt}, this astranb reads format {FORMAT}: upgrade")
    return total, header_len


def _read_header(view: memoryview, header_len: int) -> Header:
    """The header after the prefix (its bytes must be there; the kind is the prefix's)."""
    _, _, kind, total, _ = _PREFIX.unpack_from(view)
    start = _PREFIX.size
    try:
        meta = json.loads(_unzstd(view[start : start + header_len], _MAX_HEADER))
        header = Header(kind="full" if kind == KIND_FULL else "delta", policy=meta["policy"],
                        base_version=meta["base_version"], version=meta["version"],
                        base_checksum=meta["base_checksum"], checksum=meta["checksum"],
                        tensors=meta["tensors"], total_bytes=total)
        _check_table(header.tensors)
    except (ValueError, KeyError, TypeError) as error:  # a sender bug, not transit damage
        raise CorruptPayload(f"payload header is malformed: {error!r}") from error
    return header


def layout_mismatch(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> str | None:
    """Why no delta can turn `old` into `new` (other names, shapes or dtypes), or None."""
    if set(old) != set(new):
        missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        return f"old and new name different tensors (only old: {missing}, only new: {extra})"
    for name in new:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return (f"{name}: old is {a.dtype}{tuple(a.shape)}, new is {b.dtype}{tuple(b.shape)}; "
                    "a delta needs the same layout: send a full snapshot (encode_full)")
    return None


def changed_fraction(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """Fraction of elements whose bits differ between two same-layout weight sets: what a delta
    between them would carry (`encode` compares the same raw bits)."""
    _check_same_layout(old, new)
    changed = sum(int(np.count_nonzero(_bits(old[n]) != _bits(new[n]))) for n in new)
    return changed / max(sum(t.numel() for t in new.values()), 1)


def _check_same_layout(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    problem = layout_mismatch(old, new)
    if problem:
        raise ValueError(problem)


def _check_layout(header: Header, tensors: Mapping[str, torch.Tensor]) -> None:
    for entry in header.tensors:
        t = tensors.get(entry["name"])
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"apply() writes in place and needs contiguous tensors; {entry['name']!r} is not"
            )
        if t is None or list(t.shape) != entry["shape"] or str(t.dtype) != entry["dtype"]:
            raise BaseMismatch(
                f"tensor {entry['name']!r}: payload has {entry['dtype']}{tuple(entry['shape'])}, "
                f"receiver has {'nothing' if t is None else f'{t.dtype}{tuple(t.shape)}'}"
            )


def _check_base(header: Header, have: int) -> None:
    if have != header.base_checksum:
        raise BaseMismatch(
            f"delta {header.base_version}->{header.version} of {header.policy!r} was made against "
            "other weights than the receiver holds (base checksum differs); pull a full snapshot"
        )


def _check_result(header: Header, tensors: Mapping[str, torch.Tensor]) -> None:
    if checksum(tensors) != header.checksum:
        raise CorruptPayload(
            f"weights after applying version {header.version} do not match the sender's checksum; "
            "they must be replaced by a full snapshot"
        )


def dtype_named(name: str) -> torch.dtype:
    """torch dtype from its printed name (\"torch.bfloat16\" or \"bfloat16\")."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype



def _check_table(entries: list[dict[str, Any]]) -> None:
    """Every tensor entry has the fields and types the decoder relies on."""
    for e in entries:
        if not (isinstance(e["name"], str) and isinstance(e["shape"], list)
                and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                and e["scheme"] in _SCHEMES and isinstance(e["changed"], int)
                and isinstance(e["sections"], list) and e["itemsize"] in _UINT
                and all(isinstance(n, int) and n >= 0 for n in e["sections"])):
            raise ValueError(f"bad tensor entry {e!r:.200}")
        dtype_named(e["dtype"])
