"""Compile every kernel before a first sync needs it.

Why: numba compiles a kernel on its first call for each signature (its arguments' types): about
11 s for the engine's set on one core here with a cold cache, and about 1 s with a warm one (numba's
import and first dispatch). A user's first sync paid that (6.8 s against 1.8 s for the same push
once compiled). The engine calls `warm_up` in its startup placement probe (engine/worker.py
`delta_probe`), off the serving path; numba's cache (`cache=True`: beside the package, or under the
user's cache directory where that is read-only) lets a later start load the kernels instead.

Each call below passes the argument types a sync passes (element width, int32 offsets, read-only
buffers decoded from a file), so a sync of those types compiles nothing: tests/kernels/test_warmup.py
checks that a whole apply after `warm_up` adds no signature to any kernel.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from vllm_delta.kernels import switch

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GAP_WIDTHS = (1, 2, 4, 8)  # `wire.codecs.GAP_WIDTHS`: what a delta's gaps may be coded in, whatever the dtype


def warm_up(dtypes: Iterable[torch.dtype] = (torch.bfloat16,), *, sender: bool = False) -> float:
    """Compile (or load from numba's cache) the engine's kernels for values of these dtypes (the
    model's parameters and checkpoint tensors), and with `sender` the sender's too; the seconds it
    took. Nothing with the kernels switched off."""
    if not switch.on():
        return 0.0
    start = time.perf_counter()
    widths = sorted({torch.empty(0, dtype=d).element_size() for d in dtypes} & _UINT.keys())
    _engine(widths)
    if sender:
        _sender(widths)
    return time.perf_counter() - start


def _read_only(a: np.ndarray) -> np.ndarray:
    """As `np.frombuffer` gives arrays over bytes: a signature of its own to numba."""
    a.flags.writeable = False
    return a


def _engine(widths: list[int]) -> None:
    from vllm_delta.kernels import digest_jit, gaps_jit, params_jit, scatter_jit

    params_jit.scan(np.frombuffer(b"[]", dtype=np.uint8), params_jit.KEYS)  # a flush's params text

    for w in GAP_WIDTHS:  # decoded gaps: read-only over a file's bytes, writable once decompressed
        for gaps in (np.zeros(1, _UINT[w]), _read_only(np.zeros(1, _UINT[w]))):
            gaps_jit.positions(gaps, 2, -1, np.empty(1, np.int64))
    for w in widths:
        u = _UINT[w]
        digest_jit.segment_sums(np.zeros(1, np.int64), np.zeros(1, u), np.zeros(1, np.int64), 0, 1)
        flat, offsets, values = np.zeros(2, u), np.zeros(1, np.int32), np.zeros(1, u)
        scatter_jit.write(flat, offsets, values)
        scatter_jit.mismatches(flat, offsets, values)
        if w <= 4:
            scatter_jit.write_resolved(flat, offsets, values, scatter_jit.FLOAT, np.zeros(1, u))


def _sender(widths: list[int]) -> None:
    from vllm_delta.kernels import gaps_jit, scan, ulp_jit

    tables = tuple(np.array([v], np.int64) for v in (0, 32, 0, 0))
    for w in widths:
        u = _UINT[w]
        if w in (2, 4):
            for want_run in (False, True):
                scan.scan_bits(np.zeros(32, u), np.ones(32, u), tables, 1, want_run)
        if w <= 4:
            one = np.zeros(1, np.uint8)
            ulp_jit.write_ulp_streams(np.zeros(1, u), np.ones(1, u), one, one.copy(), np.zeros((w, 1), np.uint8))
    pos = np.arange(2, dtype=np.int64)
    gaps_jit.max_gap(pos, -1)
    for w in GAP_WIDTHS:
        gaps_jit.write_gap_planes(pos, -1, np.empty((w, 2), np.uint8))
