"""One tensor's part of a weight payload: how its changed positions and values are coded, and how
a payload's tensors are decoded into place, side by side on threads.

The frame around these sections (prefix, header, hash) and the public API are in codec.py; its
docstring describes the schemes ("rice", "bitmap", "dense", "raw", "same") and the value modes.
Decoding has two paths that give the same bits: whole-array numpy operations (the reference, and
the only path for small payloads), and the compiled loops of _kernels for payloads with many
changes. Either way a tensor's positions are checked against it before any value is written.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from . import _kernels
from .errors import CorruptPayload

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# zstd level 1, not 3: on these streams (bitmap bytes, zig-zag value planes: few symbols, nearly
# no repeats) level 1 came out 1-8 % smaller, ~25 % quicker to encode and no slower to decode
# (bench/RESULTS.md, "zstd level"); frames are self-describing, so readers are unaffected
_ZSTD_LEVEL = 1
_MAX_RICE_K = 40  # the encoder's largest Rice parameter (gaps up to ~2^40 x a few)


# -- sections inflated ahead of time --------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Inflated:
    """A zstd section inflated ahead of time (weights.incoming), or why it could not be.

    Used in place of the section's bytes only where the decoder asks for the same output limit;
    anywhere else the decoder inflates `raw` itself, as for any section.
    """

    raw: memoryview  # the section as it is in the payload
    skip: int  # bytes before the zstd frame (a value stream's mode byte)
    limit: int  # the most bytes it may inflate to
    data: bytes = b""
    error: str = ""  # the CorruptPayload message inflating it gave


Section = memoryview | Inflated


def _raw(part: Section) -> memoryview:
    return part.raw if isinstance(part, Inflated) else part


def _inflate(part: Section, skip: int, limit: int) -> bytes:
    """The section's zstd frame (after `skip` bytes) inflated, to at most `limit` bytes."""
    if isinstance(part, Inflated):
        if part.skip == skip and part.limit == limit:
            if part.error:
                raise CorruptPayload(part.error)
            return part.data
        part = part.raw
    return _unzstd(part[skip:], limit)


def _zstd_sections(entry: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(index in the entry's sections, skip, limit) of each zstd section, with the limits the
    decoders below ask for (_bitmap_bytes, _value_planes), so that a section inflated ahead of
    time is used."""
    size, n, itemsize = math.prod(entry["shape"]), entry["changed"], entry["itemsize"]
    last = len(entry["sections"]) - 1
    if entry["scheme"] == "dense":
        return [(0, 1, size * itemsize)]
    if entry["scheme"] == "rice":
        return [(last, 1, n * itemsize)]
    if entry["scheme"] == "bitmap":
        return [(0, 0, (size + 7) // 8), (last, 1, n * itemsize)]
    return []


# -- per tensor ------------------------------------------------------------------------------------
def _encode_tensor(
    name: str, old_bits: np.ndarray, new_bits: np.ndarray, tensor: torch.Tensor
) -> tuple[dict[str, Any], list[bytes]]:
    changed = _changed_positions(old_bits, new_bits)
    n, size = changed.size, new_bits.size
    if n == 0:
        return _entry(name, tensor, "same", 0, positions=0, values=0), []
    candidates = [("rice", _rice_encode(changed))]
    if n * 64 > size:  # a bitmap can only win when changes are denser than ~1 in 64
        candidates.append(("bitmap", _bitmap_encode(changed, size)))
    scheme, pos_parts = min(candidates, key=lambda c: sum(map(len, c[1])))
    values = _values_encode(old_bits[changed], new_bits[changed])
    pos_bytes = sum(map(len, pos_parts))
    if n * 2 > size:  # dense: every value, no positions
        dense = _values_encode(old_bits, new_bits)
        if len(dense) < pos_bytes + len(values):
            return _entry(name, tensor, "dense", n, positions=0, values=len(dense)), [dense]
    entry = _entry(name, tensor, scheme, n, positions=pos_bytes, values=len(values))
    entry["sections"] = [len(p) for p in pos_parts] + [len(values)]
    return entry, [*pos_parts, values]


def _decode_tensor(
    entry: dict[str, Any], parts: list[Section], bits: np.ndarray, compiled: bool = False
) -> None:
    scheme, n = entry["scheme"], entry["changed"]
    if scheme == "same" or bits.size == 0:
        return
    if scheme == "raw":
        raw = _raw(parts[0])
        if len(raw) != bits.nbytes:
            raise CorruptPayload(
                f"tensor {entry['name']!r}: {len(raw)} bytes, expected {bits.nbytes}"
            )
        bits[:] = np.frombuffer(raw, dtype=bits.dtype)
        return
    if scheme == "dense":
        bits[:] = _values_decode(parts[0], bits, bits.size)
        return
    if compiled:
        _apply_compiled(entry, parts, bits)
        return
    if scheme == "rice":
        idx = _rice_decode(_raw(parts[0]), _raw(parts[1]), n)
    else:
        idx = np.flatnonzero(_bitmap_decode(parts[0], bits.size))
    _check_positions(entry, idx, bits.size)
    bits[idx] = _values_decode(parts[-1], bits[idx], n)


def _apply_compiled(entry: dict[str, Any], parts: list[Section], bits: np.ndarray) -> None:
    """The rice and bitmap schemes through the compiled loops (_kernels): positions are checked
    before any value is written."""
    n = entry["changed"]
    planes, diff = _value_planes(parts[-1], bits.dtype, n)
    if entry["scheme"] == "rice":
        unary, k = _rice_header(_raw(parts[0]))
        remainders = _packed_fields(_raw(parts[1]), n, k)
        if _kernels.apply_rice(unary, remainders, k, planes, bits, diff) != n:
            raise _bad_positions(entry)  # refused before the first write (see _kernels)
        return
    packed = _bitmap_bytes(parts[0], bits.size)
    words = _kernels.big_endian_words(packed)
    past_end = np.unpackbits(packed[bits.size // 8 :])[bits.size % 8 :]  # bits past the tensor
    if np.count_nonzero(past_end) or int(np.bitwise_count(words).sum()) != n:
        raise _bad_positions(entry)
    _kernels.apply_bitmap(words, planes, bits, diff)


def _check_positions(entry: dict[str, Any], idx: np.ndarray, size: int) -> None:
    """Decoded positions: as many as the entry says, increasing (a hostile Rice stream can make
    int64 arithmetic wrap around), so all inside the tensor when the first and last are."""
    n = entry["changed"]
    if idx.size != n or (n and (idx[0] < 0 or idx[-1] >= size or np.any(idx[1:] <= idx[:-1]))):
        raise _bad_positions(entry)


def _bad_positions(entry: dict[str, Any]) -> CorruptPayload:
    return CorruptPayload(
        f"tensor {entry['name']!r}: positions do not decode to {entry['changed']} changes"
    )


def _changed_positions(old: np.ndarray, new: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """Indices where the bits differ, compared in cache-sized chunks (no tensor-sized mask)."""
    if old.size <= chunk:
        return np.flatnonzero(old != new)
    mask = np.empty(chunk, dtype=bool)
    found = []
    for start in range(0, old.size, chunk):
        stop = min(old.size, start + chunk)
        part = mask[: stop - start]
        np.not_equal(old[start:stop], new[start:stop], out=part)
        hits = np.flatnonzero(part)
        if hits.size:
            found.append(hits + start)
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


# -- positions -------------------------------------------------------------------------------------
def _rice_encode(changed: np.ndarray) -> list[bytes]:
    gaps = np.diff(changed, prepend=-1) - 1  # zero-based gaps between changed positions
    k = _rice_parameter(gaps)
    ones = np.cumsum((gaps >> k) + 1) - 1  # unary quotient: q zeros, then a one
    unary = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
    unary[ones] = 1
    remainders = b""
    if k:
        shifts = np.arange(k - 1, -1, -1, dtype=np.int64)
        remainders = np.packbits(((gaps[:, None] >> shifts) & 1).astype(np.uint8)).tobytes()
    return [bytes([k]) + np.packbits(unary).tobytes(), remainders]


def _rice_header(unary_part: memoryview) -> tuple[np.ndarray, int]:
    """The unary stream's bytes and the Rice parameter k in its first byte."""
    if len(unary_part) < 1:
        raise CorruptPayload("empty position stream")
    k = unary_part[0]
    if k > _MAX_RICE_K:
        raise CorruptPayload(f"Rice parameter {k} is out of range (at most {_MAX_RICE_K})")
    return np.frombuffer(unary_part[1:], dtype=np.uint8), k


def _rice_decode(unary_part: memoryview, rem_part: memoryview, n: int) -> np.ndarray:
    packed, k = _rice_header(unary_part)
    unary = np.unpackbits(packed).view(bool)
    ones = np.flatnonzero(unary)[:n]  # ones[i] + 1 = sum of (q_j + 1) over j <= i
    if ones.size != n:
        raise CorruptPayload(f"position stream holds {ones.size} codes, expected {n}")
    if not k or not n:
        return ones  # gap i is q_i: position i = sum of (q_j + 1) over j <= i, minus 1
    # position i = sum over j <= i of (q_j 2^k + r_j + 1), minus 1
    #            = ones[i] 2^k + sum over j <= i of (r_j + 1 - 2^k), plus 2^k - 1
    terms = _fixed_width(rem_part, n, k)
    terms += 1 - (1 << k)
    terms[0] += (1 << k) - 1  # the constant rides along in the running sum
    np.cumsum(terms, out=terms)
    ones <<= k
    ones += terms
    return ones


def _fixed_width(part: memoryview, n: int, k: int) -> np.ndarray:
    """n k-bit unsigned fields packed most significant bit first (np.packbits' order), int64."""
    data = _packed_fields(part, n, k)
    group = k // math.gcd(k, 8)  # bytes holding a whole number of fields: 8 / gcd(k, 8) of them
    if group > 8:  # k > 8 and not a multiple of 8: few, long gaps; bit by bit
        bits = np.unpackbits(data, count=n * k).reshape(n, k).astype(np.int64)
        weights = 1 << np.arange(k - 1, -1, -1, dtype=np.int64)
        result: np.ndarray = bits @ weights
        return result
    fields = group * 8 // k
    shifts = np.arange(fields - 1, -1, -1, dtype=np.int64) * k
    if group == 1:  # k = 1, 2, 4 or 8: every byte's fields from a table of all 256 bytes
        table = (np.arange(256, dtype=np.int64)[:, None] >> shifts) & ((1 << k) - 1)
        return np.take(table, data[: -(-n * k // 8)], axis=0).reshape(-1)[:n]
    groups = -(-n // fields)
    packed = np.zeros(groups * group, dtype=np.uint8)
    used = min(data.size, packed.size)
    packed[:used] = data[:used]
    columns = packed.reshape(groups, group)
    words = columns[:, 0].astype(np.int64)
    for c in range(1, group):  # each group's bytes as one big-endian integer
        words <<= 8
        words |= columns[:, c]
    out = words[:, None] >> shifts
    out &= (1 << k) - 1
    return out.reshape(-1)[:n]


def _packed_fields(part: memoryview, n: int, k: int) -> np.ndarray:
    """The bytes of a stream of n k-bit fields (the Rice remainders), checked to hold them all."""
    data = np.frombuffer(part, dtype=np.uint8)
    if data.size * 8 < n * k:
        raise CorruptPayload("remainder stream too short")
    return data


def _rice_parameter(gaps: np.ndarray) -> int:
    """The k in 0..40 that makes the code shortest (total bits = n(k+1) + sum(g >> k))."""
    mean = float(gaps.mean())
    guess = max(0, int(np.log2(max(mean * 0.69, 1.0))))
    best = min(range(max(0, guess - 1), min(_MAX_RICE_K, guess + 2)),
               key=lambda k: gaps.size * (k + 1) + int((gaps >> k).sum()))
    return best


def _bitmap_encode(changed: np.ndarray, size: int) -> list[bytes]:
    mask = np.zeros(size, dtype=bool)
    mask[changed] = True
    return [_zstd(np.packbits(mask).tobytes())]


def _bitmap_bytes(part: Section, size: int) -> np.ndarray:
    """A bitmap section's packed bytes (packbits' order), at least `size` bits of them."""
    packed = np.frombuffer(_inflate(part, 0, (size + 7) // 8), dtype=np.uint8)
    if packed.size * 8 < size:
        raise CorruptPayload("bitmap shorter than its tensor")
    return packed


def _bitmap_decode(part: Section, size: int) -> np.ndarray:
    return np.unpackbits(_bitmap_bytes(part, size), count=size).view(bool)


# -- values ----------------------------------------------------------------------------------------
def _values_encode(old: np.ndarray, new: np.ndarray) -> bytes:
    """Zig-zag bit differences or raw new bits, byte-plane split and zstd'ed: the smaller."""
    width = new.dtype.itemsize * 8
    signed = (new - old).view(np.dtype(f"i{new.dtype.itemsize}"))
    zigzag = ((signed << 1) ^ (signed >> (width - 1))).view(new.dtype)
    diff = _zstd(_planes(zigzag))
    raw = _zstd(_planes(new))
    return (b"d" + diff) if len(diff) <= len(raw) else (b"r" + raw)


def _value_planes(part: Section, dtype: np.dtype, n: int) -> tuple[np.ndarray, bool]:
    """A value stream's byte planes (itemsize x n, uint8) and whether they hold zig-zag mapped
    bit differences (True) or the new bits themselves (False)."""
    raw = part.raw if isinstance(part, Inflated) else part
    if len(raw) < 1:
        raise CorruptPayload("empty value stream")
    mode, planes = bytes(raw[:1]), _inflate(part, 1, n * dtype.itemsize)
    if len(planes) != n * dtype.itemsize:
        expected = n * dtype.itemsize
        raise CorruptPayload(f"value stream holds {len(planes)} bytes, expected {expected}")
    if mode not in (b"d", b"r"):
        raise CorruptPayload(f"unknown value mode {mode!r}")
    return np.frombuffer(planes, dtype=np.uint8).reshape(dtype.itemsize, n), mode == b"d"


def _values_decode(part: Section, old: np.ndarray, n: int) -> np.ndarray:
    """The new values: from the stream, with `old` (the values they replace) for differences."""
    planes, diff = _value_planes(part, old.dtype, n)
    values = _unplanes(planes, old.dtype, n)
    if not diff:
        return values
    # undo the zig-zag map, then add in wrap-around (mod 2^bits) arithmetic, in place (`values`
    # is _unplanes' new array)
    sign = values & 1
    np.negative(sign, out=sign)  # 0 or all ones
    values >>= 1
    values ^= sign
    values += old
    return values


def _planes(values: np.ndarray) -> bytes:
    """Little-endian bytes regrouped so byte i of every value is together (plane i)."""
    return values.view(np.uint8).reshape(-1, values.dtype.itemsize).T.tobytes()


def _unplanes(planes: np.ndarray, dtype: np.dtype, n: int) -> np.ndarray:
    """A new array of n values from their byte planes (itemsize x n; a plane at a time: ~7x
    faster for bf16 than one transposing copy)."""
    out = np.empty(n, dtype=dtype)
    columns = out.view(np.uint8).reshape(n, dtype.itemsize)
    for i in range(dtype.itemsize):
        columns[:, i] = planes[i]
    return out



# -- a payload's tensors, on threads ---------------------------------------------------------------
_PARALLEL_WORK = 1 << 20  # elements to decode before a payload is split over threads
_MAX_THREADS = 8
# changes (in rice and bitmap tensors) before a payload goes through the compiled loops: below
# it numpy takes milliseconds, and a process that only ever sees small deltas (a tiny model, a
# test) never pays numba's ~0.6 s load
_COMPILED_WORK = 1 << 18
_Job = tuple[int, int, dict[str, Any], list[Section], np.ndarray]  # work, index, entry, ...


def _apply_sections(
    entries: list[dict[str, Any]],
    body: memoryview,
    tensors: Mapping[str, torch.Tensor],
    ready: Mapping[int, Inflated] | None = None,
) -> None:
    """Decode every tensor's sections (`body`, in the order of `entries`) into `tensors`.

    `ready`: sections already inflated (weights.incoming), by their offset in `body`.
    """
    jobs: list[_Job] = []
    ready = ready or {}
    for entry, spans in _section_spans(entries):
        parts: list[Section] = []
        for start, end in spans:
            early = ready.get(start)
            parts.append(early if early is not None and len(early.raw) == end - start
                         else body[start:end])
        bits = _bits(tensors[entry["name"]], writable=True)
        work = entry["changed"] if entry["scheme"] in ("rice", "bitmap") else bits.size
        if entry["scheme"] != "same":
            jobs.append((work, len(jobs), entry, parts, bits))
    changes = sum(e["changed"] for e in entries if e["scheme"] in ("rice", "bitmap"))
    compiled = changes >= _COMPILED_WORK and _kernels.available()
    threads = min(_cpus(), _MAX_THREADS, len(jobs))
    if threads < 2 or sum(job[0] for job in jobs) < _PARALLEL_WORK:
        for job in jobs:
            _decode_job(job, compiled)
        return
    # tensors are independent: numpy and zstd release the GIL, so threads decode side by side;
    # largest first, so they finish together
    jobs.sort(key=lambda job: -job[0])
    queue, lock = iter(jobs), threading.Lock()
    errors: dict[int, BaseException] = {}

    def worker() -> None:
        while not errors:
            with lock:
                job = next(queue, None)
            if job is None:
                return
            try:
                _decode_job(job, compiled)
            except BaseException as error:  # re-raised below, in the caller's thread
                errors[job[1]] = error

    helpers = [threading.Thread(target=worker, name="astranb-decode", daemon=True)
               for _ in range(threads - 1)]
    for helper in helpers:
        helper.start()
    worker()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[min(errors)]  # the first failing tensor in the payload's order


def _section_spans(
    entries: list[dict[str, Any]],
) -> Iterator[tuple[dict[str, Any], list[tuple[int, int]]]]:
    """Each tensor entry with its sections' (start, end) in the payload's body, in order (the
    offsets weights.incoming keys the sections it inflated ahead by)."""
    offset = 0
    for entry in entries:
        spans = []
        for size in entry["sections"]:
            spans.append((offset, offset + size))
            offset += size
        yield entry, spans


def _decode_job(job: _Job, compiled: bool) -> None:
    _, _, entry, parts, bits = job
    try:
        _decode_tensor(entry, parts, bits, compiled)
    except zstandard.ZstdError as error:
        raise CorruptPayload(f"tensor {entry['name']!r}: {error}") from error


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# -- helpers ---------------------------------------------------------------------------------------
def _entry(
    name: str, tensor: torch.Tensor, scheme: str, changed: int, *, positions: int, values: int
) -> dict[str, Any]:
    return {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
            "itemsize": tensor.element_size(), "scheme": scheme, "changed": int(changed),
            "positions": positions, "values": values}


def _bits(t: torch.Tensor, writable: bool = False) -> np.ndarray:
    """The tensor's raw bits as a flat unsigned numpy array (shares memory when it can)."""
    if t.device.type != "cpu":
        raise ValueError("weight payloads are built from CPU tensors; call .cpu() first")
    if writable and not t.is_contiguous():
        raise ValueError("apply() writes in place and needs contiguous tensors")
    t = t.detach().contiguous()
    size = t.element_size()
    if size not in _TORCH_INT:
        raise ValueError(f"unsupported element size {size} for dtype {t.dtype}")
    return t.view(_TORCH_INT[size]).reshape(-1).numpy().view(_UINT[size])


# -- zstd ------------------------------------------------------------------------------------------
_contexts = threading.local()  # zstd contexts are costly to make and not shareable by threads


def _zstd(data: bytes) -> bytes:
    compressor = getattr(_contexts, "compressor", None)
    if compressor is None:
        compressor = _contexts.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return compressor.compress(data)


def _unzstd(data: bytes | memoryview, limit: int) -> bytes:
    """Decompress at most `limit` bytes; a frame that claims more is refused before allocating."""
    try:
        claimed = zstandard.frame_content_size(data)
        if claimed > limit:
            raise CorruptPayload(
                f"compressed section claims {claimed} bytes, at most {limit} expected"
            )
        decompressor = getattr(_contexts, "decompressor", None)
        if decompressor is None:
            decompressor = _contexts.decompressor = zstandard.ZstdDecompressor()
        return decompressor.decompress(data, max_output_size=limit)
    except zstandard.ZstdError as error:
        raise CorruptPayload(f"compressed section does not decompress: {error}") from error
