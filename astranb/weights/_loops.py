"""The compiled loops behind astranb.weights._kernels (imported only there, on first use, since
importing numba takes ~0.3 s). Read _kernels' docstring for what they do; the two apply_ loops
return the number of changes handled, or -1 when a position falls outside the tensor (nothing at
or past that position was written). Arithmetic runs in uint64 and is truncated on store:
addition modulo 2^(8 x itemsize)."""

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

@njit(inline="always")
def _popcount(x):
    x = x - ((x >> np.uint64(1)) & _M1)
    x = (x & _M2) + ((x >> np.uint64(2)) & _M2)
    x = (x + (x >> np.uint64(4))) & _M4
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@njit(nogil=True, cache=True)
def rice_last(unary_u64, rem_u8, k, n, size):
    # The last of the first n positions, from two sums and no decoding: position n-1 is
    # sum(q) 2^k + sum(r) + n - 1. sum(q) + n is the number of unary bits up to and including the
    # n-th one; sum(r) adds each remainder bit at its weight, a byte at a time from tables (the
    # weights of a byte's bits repeat every k / gcd(k, 8) bytes). -1: fewer than n codes, or a
    # position at or past `size` (the sums only grow, so they stop early).
    if n <= 0:
        return -1
    seen, end = 0, -1
    one = np.uint64(1)
    for i in range(unary_u64.size):
        c = _popcount(unary_u64[i])
        if seen + c >= n:
            w = _reverse(unary_u64[i])
            for _ in range(n - seen - 1):
                w &= w - one
            end = i * 64 + trailing_zeros(w)  # the n-th one, in stream order
            break
        seen += c
    if end < 0:
        return -1
    sum_q = end + 1 - n
    if sum_q > (size >> k):
        return -1
    sum_r = 0
    if k:
        period = 1  # k / gcd(k, 8) bytes
        while (period * 8) % k:
            period += 1
        table = np.zeros((period, 256), np.int64)
        for phase in range(period):
            for j in range(8):
                weight = np.int64(1) << (k - 1 - (phase * 8 + j) % k)
                for value in range(256):
                    if (value >> (7 - j)) & 1:
                        table[phase, value] += weight
        total_bits = n * k
        full = total_bits // 8
        for t in range(full):
            sum_r += table[t % period, rem_u8[t]]
            if sum_r >= size:
                return -1
        tail = total_bits % 8
        if tail:
            sum_r += table[full % period, rem_u8[full] & ((0xFF << (8 - tail)) & 0xFF)]
    last = (sum_q << k) + sum_r + n - 1
    return last if last < size else -1


@njit(nogil=True, cache=True)
def apply_rice(unary_u64, rem_u64, k, planes_u8, bits, diff):
    # unary: q zeros then a one per gap (big-endian words, reversed here so the next one is the
    # lowest set bit); remainders: k bits each, MSB first, as big-endian words with one spare word
    # after them. With B the index of code j's one in the unary stream and R the sum of the
    # remainders up to j, position j = (B - j) 2^k + R + j: only R runs from code to code.
    # Each position's value is written as it is found (values as in apply_bitmap).
    width, n = planes_u8.shape
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
            if p >= size:
                return -1
            v = np.uint64(planes_u8[0, j])
            if width == 2:
                v |= np.uint64(planes_u8[1, j]) << np.uint64(8)
            else:
                for c in range(1, width):
                    v |= np.uint64(planes_u8[c, j]) << np.uint64(8 * c)
            if diff:
                bits[p] = np.uint64(bits[p]) + ((v >> one) ^ (np.uint64(0) - (v & one)))
            else:
                bits[p] = v
            j += 1
        if j >= n:
            break
    return j
