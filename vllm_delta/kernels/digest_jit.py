"""`digest`'s terms and sums as numba functions (`segment_sums`, and the lanes and `range_sums` that
`scan_jit` sums with as it goes), with `lanes.LANES`' constants frozen in at compile time."""

from __future__ import annotations

import numpy as np

from vllm_delta.kernels.lanes import LANES
from vllm_delta.kernels.switch import kernel


def _u64(c: int) -> np.uint64:
    return np.uint64(c & ((1 << 64) - 1))


_G0, (_A0, _B0, _C0), (_M0, _N0) = _u64(LANES[0][0]), map(_u64, LANES[0][1]), map(_u64, LANES[0][2])
_G1, (_A1, _B1, _C1), (_M1, _N1) = _u64(LANES[1][0]), map(_u64, LANES[1][1]), map(_u64, LANES[1][2])
NO_SEGMENTS = np.empty(0, np.int64)  # `segment_sums`' segments when one segment takes every entry


@kernel
def lane0(x):  # splitmix64's finaliser: digest.mix_(x, 0)
    x ^= x >> _A0
    x *= _M0
    x ^= x >> _B0
    x *= _N0
    return x ^ (x >> _C0)


@kernel
def lane1(x):  # Murmur3's fmix64 of the key XOR its constant: digest.mix_(x ^ LANES[1][0], 1)
    x ^= _G1
    x ^= x >> _A1
    x *= _M1
    x ^= x >> _B1
    x *= _N1
    return x ^ (x >> _C1)


@kernel
def range_sums(positions, bits, a, b):
    """Both lane sums of the terms of entries a..b-1 (`digest.keys`: position << width | bits up to
    32-bit values, else lane 0 of the offset position XOR the bits). One loop LLVM vectorises."""
    s0, s1 = np.uint64(0), np.uint64(0)
    width = np.uint64(8 * bits.itemsize)
    if bits.itemsize <= 4:
        for i in range(a, b):
            k = (np.uint64(positions[i]) << width) | np.uint64(bits[i])
            s0 += lane0(k)
            s1 += lane1(k)
    else:
        for i in range(a, b):
            k = lane0(np.uint64(positions[i]) * _G0 + _G0) ^ np.uint64(bits[i])
            s0 += lane0(k)
            s1 += lane1(k)
    return s0, s1


@kernel
def segment_sums(positions, bits, segments, segment, n):
    """uint64[n, 2]: per segment (segments[i], or `segment` for all when `segments` is empty) the
    lane sums of the entries' terms, a run of equal segments at a time (so the inner loop vectorises)."""
    out = np.zeros((n, 2), np.uint64)
    total = positions.size
    a = 0
    while a < total:
        s = segments[a] if segments.size else segment
        b = a + 1 if segments.size else total
        while b < total and segments[b] == s:
            b += 1
        if s < 0 or s >= n:
            raise IndexError("a segment outside [0, n)")
        s0, s1 = range_sums(positions, bits, a, b)
        out[s, 0] += s0
        out[s, 1] += s1
        a = b
    return out
