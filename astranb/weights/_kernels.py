"""Compiled inner loops of the delta decoder: positions and values applied in one or two passes.

The numpy decoder in _sections.py takes ~8 passes over a delta's changes (decode the positions into
an array, gather the old values, undo the zig-zag map, add, scatter back...), ~8 ns per changed
element on one core. These loops do it in one or two passes, ~2-4 ns, compiled by numba when it is
installed (it is a dependency; without it _sections.py keeps its numpy path, which gives the same
bits). Nothing here reads outside its arrays or writes outside the tensor: a payload that hashes
correctly but whose positions do not fit (a sender bug, or a hostile sender) is refused before
anything is written, and the loops themselves stop at a position outside the tensor.

    bitmap section (zstd'ed packbits, MSB first)     rice sections (unary quotients, remainders)
            |                                                 |
     words_u64 (big-endian 64-bit words)          apply_rice: 1. every position into an array;
            |                                     fewer than n, or the last past the tensor:
            |                                     refused. 2. the values, at those positions
     apply_bitmap(words_u64, planes_u8, bits, diff)                   |
            \\_______________ bits[p] += unzigzag(v)  or  bits[p] = v ______________/

The value stream carries, per change, either the zig-zag mapped difference of the bit patterns
(diff=True: added modulo 2^bits) or the new bits (diff=False); `planes_u8` is it as decompressed
(itemsize x n byte planes). A bitmap's positions are checked by its popcount and the bits past the
tensor (in _sections.py); a Rice stream's by their count and each one, all decoded before the first
write. The bitmap loop writes as it walks (at the densities where a bitmap is chosen, >~15 %, that
is quickest); the Rice loop decodes first and writes in a loop of its own, where the CPU overlaps
the scattered loads and stores.

Loading numba and its cached machine code takes ~0.6 s the first time in a process (compiling,
~1 s, happens once per machine). `warm()` does it on a background thread: a Mirror calls it when
it takes its first full snapshot, so the first delta does not wait.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from types import ModuleType

import numpy as np

__all__ = ["available", "warm", "apply_bitmap", "apply_rice", "big_endian_words"]

_loops: ModuleType | None = None  # astranb.weights._loops, once _load() has imported it
_loaded = False
_load_lock = threading.Lock()
_warming = False
_warmed: set[tuple[np.dtype, ...]] = set()


def available() -> bool:
    """True when the compiled loops are in use: numba imports (on first call; it takes ~0.3 s,
    so `import astranb` does not pay it) and ASTRANB_NO_NUMBA is not set."""
    if not _loaded:
        _load()
    return _loops is not None


def warm(dtypes: Iterable[np.dtype] = (np.dtype(np.uint16),)) -> None:
    """Load the loops and their code for these unsigned dtypes, on a background thread (returns
    at once; a second call while the first runs does nothing)."""
    global _warming
    wanted = tuple(sorted({np.dtype(d) for d in dtypes}, key=str))
    with _load_lock:
        if _loaded and (_loops is None or wanted in _warmed) or _warming:
            return
        _warming = True

    def run() -> None:
        global _warming
        try:
            if available():
                for dtype in wanted:
                    _exercise(dtype)
                _warmed.add(wanted)
        finally:
            _warming = False

    threading.Thread(target=run, name="astranb-warm-kernels", daemon=True).start()


def _exercise(dtype: np.dtype) -> None:
    """Call every loop once on a few elements of `dtype` (loads or compiles its code)."""
    bits = np.zeros(64, dtype=dtype)
    planes = np.ones((dtype.itemsize, 1), dtype=np.uint8)
    apply_bitmap(big_endian_words(np.array([128], dtype=np.uint8)), planes, bits, True)
    apply_rice(np.array([128], dtype=np.uint8), np.zeros(1, dtype=np.uint8), 1, planes, bits, False)


def big_endian_words(packed_u8: np.ndarray, spare: int = 0) -> np.ndarray:
    """Bytes as 64-bit words whose most significant bit is the first bit (packbits' order),
    zero-padded to a whole word, then `spare` zero words more."""
    words = -(-packed_u8.size // 8) + spare
    padded = np.zeros(words * 8, dtype=np.uint8)
    padded[: packed_u8.size] = packed_u8
    return padded.view(">u8").astype(np.uint64)


# -- loading ---------------------------------------------------------------------------------------
def _load() -> None:
    global _loops, _loaded
    with _load_lock:
        if _loaded:
            return
        try:
            if os.environ.get("ASTRANB_NO_NUMBA"):
                raise ImportError("disabled by ASTRANB_NO_NUMBA")
            from . import _loops as compiled  # imports numba
        except ImportError:
            _loops = None
        else:
            _loops = compiled
        _loaded = True


# -- entry points ----------------------------------------------------------------------------------
def apply_bitmap(words_u64: np.ndarray, planes_u8: np.ndarray, bits: np.ndarray, diff: bool) -> int:
    """Write values at the set bits of a bitmap (see the module's docstring)."""
    assert _loops is not None, "call available() first"
    return int(_loops.apply_bitmap(words_u64, planes_u8, bits, diff))


def apply_rice(unary_u8: np.ndarray, rem_u8: np.ndarray, k: int, planes_u8: np.ndarray,
               bits: np.ndarray, diff: bool) -> int:
    """Write values at the positions of a Rice-coded gap stream (n = the planes' length): -1, and
    nothing written, when the streams hold fewer than n codes or a position is not in the
    tensor."""
    assert _loops is not None, "call available() first"
    n = planes_u8.shape[1]
    if rem_u8.size * 8 < n * k:
        return -1
    rem_words = big_endian_words(rem_u8, spare=1)  # the loop reads one word past a field's start
    positions = np.empty(n, dtype=np.int64)
    return int(_loops.apply_rice(big_endian_words(unary_u8), rem_words, k, planes_u8, bits, diff,
                                 positions))
