"""The compiled loops behind astranb.weights._kernels (imported only there, on first use, since
importing numba takes ~0.3 s). Read _kernels' docstring for what they do; each returns the
number of changes handled, or -1 when a position falls outside the tensor (nothing at or past
that position was written). Arithmetic runs in uint64 and is truncated on store: addition modulo
2^(8 x itemsize)."""

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

# cache=True: compiled once per machine into __pycache__ (or numba's user cache directory)


@njit(nogil=True, cache=True)
def apply_bitmap(words_u64, planes_u8, bits, diff):
    width, n = planes_u8.shape
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
            j += 1
    return j

@njit(nogil=True, cache=True)
def apply_at(positions_i64, values, bits, diff):
    size = bits.size
    one = np.uint64(1)
    for j in range(positions_i64.size):
        p = positions_i64[j]
        if p < 0 or p >= size:
            return -1
        v = np.uint64(values[j])
        if diff:
            bits[p] = np.uint64(bits[p]) + ((v >> one) ^ (np.uint64(0) - (v & one)))
        else:
            bits[p] = v
    return positions_i64.size

@njit(nogil=True, cache=True)
def rice_positions(unary_u64, rem_u8, k, n, out_i64):
    # unary: q zeros then a one per gap (big-endian words, reversed here so the next one is the
    # lowest set bit); remainders: k bits each, MSB first, read through a 64-bit buffer
    j, last, zeros = 0, np.int64(-1), np.int64(0)
    one = np.uint64(1)
    acc, avail, byte = np.uint64(0), 0, 0  # buffered remainder bits, at the top of acc
    for i in range(unary_u64.size):
        w = _reverse(unary_u64[i])
        consumed = 0  # bits of this word already read
        while w and j < n:
            tz = trailing_zeros(w)
            w &= w - one
            zeros += tz - consumed
            consumed = tz + 1
            r = np.int64(0)
            if k:
                while avail <= 56 and byte < rem_u8.size:
                    acc |= np.uint64(rem_u8[byte]) << np.uint64(56 - avail)
                    avail += 8
                    byte += 1
                if avail < k:  # the stream ends early: the caller checked its length
                    return j
                r = np.int64(acc >> np.uint64(64 - k))
                acc = acc << np.uint64(k)
                avail -= k
            last += (zeros << k) + r + 1
            out_i64[j] = last
            zeros = np.int64(0)
            j += 1
        if j >= n:
            break
        zeros += 64 - consumed
    return j
