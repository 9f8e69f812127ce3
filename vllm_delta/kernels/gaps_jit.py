"""Gap-coded positions in one pass each way (numba, imported on first use: numba costs ~0.3 s to
import): `wire.codecs.decode_gaps`' kernel, and `codecs.gap_width` and `codecs.gap_planes`' for the
sender. Tested equal to the numpy codecs (the numpy code makes five passes and three int64
temporaries over a param's changes one way, about as many the other)."""

from __future__ import annotations

import numpy as np

from vllm_delta.kernels.jit import kernel

OK, GAP, RANGE, ORDER = 0, 1, 2, 3  # what `positions` found (codecs.decode_gaps raises the matching error)


@kernel
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


@kernel
def max_gap(pos, prev):
    """The largest pos[k] - pos[k - 1] - 1, with pos[-1] = prev."""
    top = pos[0] - prev - 1
    for k in range(1, pos.size):
        top = max(top, pos[k] - pos[k - 1] - 1)
    return top


@kernel
def _gaps(pos, prev, out):
    out[0] = pos[0] - prev - 1
    for k in range(1, pos.size):
        out[k] = pos[k] - pos[k - 1] - 1


@kernel
def _planes(pos, prev, g, out):
    """Compiled per gap dtype (`g`, the width's unsigned type), so the byte loop has a constant count."""
    _gaps(pos, prev, g)  # narrowed: every gap fits the width
    for j in range(g.itemsize):  # a row at a time: each a vectorised shift of g (in L1/L2)
        row = out[j]
        for k in range(pos.size):
            row[k] = np.uint8((g[k] >> (8 * j)) & 0xFF)


_GAP_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def write_gap_planes(pos: np.ndarray, prev: int, out: np.ndarray) -> None:
    """Byte j of each gap pos[k] - pos[k - 1] - 1 (pos[-1] = prev) into out[j, k], little-endian:
    `encode_gaps` narrowed to out's width, split by `to_planes`."""
    _planes(pos, prev, np.empty(pos.size, _GAP_TYPES[out.shape[0]]), out)
