"""The compiled loops behind astranb.weights._kernels (imported only there, on first use, since
importing numba takes ~0.3 s). Read _kernels' docstring for what they do; each returns the number
of changes handled, or -1 when a position falls outside the tensor (apply_bitmap: nothing at or
past that position was written; apply_rice: nothing was written). Arithmetic runs in uint64 and is
truncated on store: addition modulo 2^(8 x itemsize)."""

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(
    0x0F0F0F0F0F0F0F0F)
_M8, _M16 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)


@njit(inline="always")
def _reverse(w):
    """The bits of a 64-bit word in reverse order (the first element's bit becomes bit 0)."""
    w = ((w >> np.uint64(1)) & _M1) | ((w & _M1) << np.uint64(1))
    w = ((w >> np.uint64(2)) & _M2) | ((w & _M2) << np.uint64(2))
    w = ((w >> np.uint64(4)) & _M4) | ((w & _M4) << np.uint64(4))
    w = ((w >> np.uint64(8)) & _M8) | ((w & _M8) << np.uint64(8))
    w = ((w >> np.uint64(16)) & _M16) | ((w & _M16) << np.uint64(16))
    return (w >> np.uint64(32)) | (w << np.uint64(32))


@njit(inline="always")
def _write(planes_u8, j, bits, p, diff):
    """Change j: its value from the byte planes, added to bits[p] as an unzigzagged difference
    (diff) or stored as the new bits."""
    width = planes_u8.shape[0]
    one = np.uint64(1)
    v = np.uint64(planes_u8[0, j])
    if width == 2:  # bf16 and fp16: the common case, unrolled
        v |= np.uint64(planes_u8[1, j]) << np.uint64(8)
    else:
        for b in range(1, width):
            v |= np.uint64(planes_u8[b, j]) << np.uint64(8 * b)
    if diff:
        bits[p] = np.uint64(bits[p]) + ((v >> one) ^ (np.uint64(0) - (v & one)))
    else:
        bits[p] = v


# cache=True: compiled once per machine into __pycache__ (or numba's user cache directory)
@njit(nogil=True, cache=True)
def apply_bitmap(words_u64, planes_u8, bits, diff):
    n = planes_u8.shape[1]
    size, j = bits.size, 0
    one = np.uint64(1)
    for i in range(words_u64.size):
        w = _reverse(words_u64[i])
        base = i * 64
        while w:
            p = base + trailing_zeros(w)
            w &= w - one
            if j >= n or p >= size:
                return -1
            _write(planes_u8, j, bits, p, diff)
            j += 1
    return j


@njit(nogil=True, cache=True)
def apply_rice(unary_u64, rem_u64, k, planes_u8, bits, diff, positions_i64):
    # Two phases. First every position into positions_i64: unary: q zeros then a one per gap
    # (big-endian words, reversed here so the next one is the lowest set bit); remainders: k bits
    # each, MSB first, as big-endian words with a spare word after them. With b the index of code
    # j's one in the unary stream and `total` the sum of the remainders up to j, position j is
    # (b - j) 2^k + total + j. Then, only when there are n positions, all inside the tensor, the
    # values (as in apply_bitmap): a loop of its own, whose loads and stores the CPU overlaps far
    # better than inside the decoding loop (~2.5x at 1 % changed). Each position is checked, not
    # just the last: a hostile stream can make the int64 arithmetic wrap around.
    n = planes_u8.shape[1]
    size, j, total = bits.size, 0, np.int64(0)
    one = np.uint64(1)
    top = np.uint64(64 - k) if k else np.uint64(0)
    for i in range(unary_u64.size):
        w = _reverse(unary_u64[i])
        base = i * 64
        while w and j < n:
            b = base + trailing_zeros(w)
            w &= w - one
            if k:  # the k bits at j k, from the word they start in and the next
                at = j * k
                shift = np.uint64(at & 63)
                pair = (rem_u64[at >> 6] << shift) | ((rem_u64[(at >> 6) + 1] >> one)
                                                       >> (np.uint64(63) - shift))
                total += np.int64(pair >> top)
            p = ((b - j) << k) + total + j
            if p < 0 or p >= size:
                return -1
            positions_i64[j] = p
            j += 1
        if j >= n:
            break
    if j < n:
        return -1
    for j in range(n):
        _write(planes_u8, j, bits, positions_i64[j], diff)
    return n
