"""The numba kernels of `scan_kernel` (imported on first use: numba costs ~0.3 s to import).

Per chunk of a run: xor of both sides into an L1 scratch (a vectorised loop over local views),
the changed elements' indices from the scratch's nonzero 64-bit words (branch-free within a
word), then per change its outputs and its four digest terms (`wire.additive`: key = HF position
<< width | bits; lane 0 splitmix64's finaliser, lane 1 Murmur3's fmix64 of key ^ its constant),
summed mod 2^64 per run and added to the run's member.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Elements xored into the scratch at a time: two 4 KiB reads and a 4 KiB write stay in L1.
CHUNK = 2048
_M1_0, _M2_0 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 (lane 0)
_K_1 = np.uint64(0xC2B2AE3D27D4EB4F)  # lane 1's key is XORed with this first (wire.additive._LANES)
_M1_1, _M2_1 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # Murmur3 fmix64 (lane 1)


@njit(nogil=True, cache=True)
def _lane0(x):  # splitmix64's finaliser; additive._mix_ with _LANES[0]
    x ^= x >> np.uint64(30)
    x *= _M1_0
    x ^= x >> np.uint64(27)
    x *= _M2_0
    return x ^ (x >> np.uint64(31))


@njit(nogil=True, cache=True)
def _lane1(x):  # Murmur3's fmix64 of the key XOR its first constant; additive._mix_ with _LANES[1]
    x ^= _K_1
    x ^= x >> np.uint64(33)
    x *= _M1_1
    x ^= x >> np.uint64(33)
    x *= _M2_1
    return x ^ (x >> np.uint64(33))


@njit(nogil=True, cache=True)
def _grow(a, n):
    b = np.empty(2 * a.size, a.dtype)
    b[:n] = a[:n]
    return b


@njit(nogil=True, cache=True)
def scan_runs(cur, snap, starts, ends, shifts, segs, lo, hi, nseg, want_run):
    """Changes of `cur` vs `snap` inside the runs, clipped to [lo, hi): (count, offsets, HF
    positions, old bits, new bits, runs, sums[nseg, 4] = pre lane 0, pre lane 1, post 0, post 1).
    Per chunk: xor into the scratch (vectorised), the changed elements' indices from the
    nonzero words (branch-free within a word), then their outputs and digest terms."""
    width = np.uint64(8 * cur.itemsize)
    per = 8 // cur.itemsize  # elements per 64-bit word of the scratch
    cap = max(CHUNK, (hi - lo) >> 5)
    pos = np.empty(cap, np.int64)
    hfs = np.empty(cap, np.int64)
    old = np.empty(cap, cur.dtype)
    new = np.empty(cap, cur.dtype)
    run = np.empty(cap if want_run else 1, np.int64)
    sums = np.zeros((nseg, 4), np.uint64)
    d = np.zeros(CHUNK, cur.dtype)
    words = d.view(np.uint64)
    at = np.empty(CHUNK, np.int64)  # a chunk's changed indices
    k = 0
    for r in range(starts.size):
        a, e = max(starts[r], lo), min(ends[r], hi)
        shift = shifts[r]
        pre0, pre1, post0, post1 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
        for c in range(a, e, CHUNK):
            m = min(CHUNK, e - c)
            x, y = cur[c:c + m], snap[c:c + m]  # local views: the loop vectorises
            for i in range(m):
                d[i] = x[i] ^ y[i]
            nw = (m + per - 1) // per
            for i in range(m, nw * per):  # the last word's tail past the run: no change
                d[i] = 0
            found = 0
            for j in range(nw):
                if words[j] != 0:
                    for i in range(j * per, j * per + per):
                        at[found] = i
                        found += d[i] != 0
            if k + found > pos.size:
                pos, hfs, old, new = _grow(pos, k), _grow(hfs, k), _grow(old, k), _grow(new, k)
                if want_run:
                    run = _grow(run, k)
            for t in range(found):
                i = at[t]
                p = c + i
                h = p + shift
                ov, nv = y[i], x[i]
                pos[k + t], hfs[k + t], old[k + t], new[k + t] = p, h, ov, nv
                key = np.uint64(h) << width
                ko, kn = key | np.uint64(ov), key | np.uint64(nv)
                pre0 += _lane0(ko)
                pre1 += _lane1(ko)
                post0 += _lane0(kn)
                post1 += _lane1(kn)
            if want_run:
                run[k:k + found] = r
            k += found
        s = segs[r]
        sums[s, 0] += pre0
        sums[s, 1] += pre1
        sums[s, 2] += post0
        sums[s, 3] += post1
    return k, pos, hfs, old, new, run, sums
