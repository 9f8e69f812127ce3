"""The numba kernel of `codecs.decode_gaps` (imported on first use: numba costs ~0.3 s to import)."""

from __future__ import annotations

import numpy as np
from numba import njit

OK, GAP, RANGE, ORDER = 0, 1, 2, 3  # what `positions` found (codecs.decode_gaps raises the matching error)


@njit(nogil=True, cache=True)
def positions(gaps, numel, prev, out):
    """out[i] = prev + sum(gaps[:i + 1] + 1), wrapping like numpy's int64 cumsum, and which of
    decode_gaps' checks fails first: a gap >= numel (before anything is summed), the first or last
    position outside [0, numel), a position not above the one before it (a wrapped sum), or OK."""
    n = gaps.size
    top = np.uint64(numel)
    big = False
    for i in range(n):  # its own pass, branch-free: the sum below then vectorises
        big |= np.uint64(gaps[i]) >= top
    if big:
        return GAP
    p = np.uint64(prev)
    one = np.uint64(1)
    for i in range(n):
        p += np.uint64(gaps[i]) + one
        out[i] = np.int64(p)
    if n == 0:
        return OK
    if out[0] < 0 or out[n - 1] >= numel:
        return RANGE
    down = False
    for i in range(1, n):
        down |= out[i] <= out[i - 1]
    return ORDER if down else OK
