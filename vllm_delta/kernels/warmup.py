"""Compile every kernel before a first sync needs it (numba compiles on a signature's first call, 11-17 s
cold): the engine's startup probe and `DeltaSender.seed` call `warm_up` with a sync's argument types."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from vllm_delta.kernels import switch

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def warm_up(
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,), *, engine: bool = True, sender: bool = False
) -> float:
    """Compile (or load from numba's cache) the digest's kernel, the engine's and/or the sender's, for
    values of these dtypes; the seconds it took (none with the kernels switched off)."""
    if not switch.on():
        return 0.0
    start = time.perf_counter()
    from vllm_delta.kernels import digest_jit, params_jit, scan, scatter_jit, ulp_jit

    if engine:
        params_jit.scan(np.frombuffer(b"[]", dtype=np.uint8), params_jit.KEYS)
    tables = tuple(np.array([v], np.int64) for v in (0, 32, 0, 0))
    for w in sorted({torch.empty(0, dtype=d).element_size() for d in dtypes} & _UINT.keys()):
        u = _UINT[w]
        digest_jit.segment_sums(np.zeros(1, np.int64), np.zeros(1, u), np.zeros(1, np.int64), 0, 1)
        flat, offsets, values = np.zeros(2, u), np.zeros(1, np.int32), np.zeros(1, u)
        if engine:
            scatter_jit.write(flat, offsets, values)
            scatter_jit.mismatches(flat, offsets, values)
            if w <= 4:
                scatter_jit.write_resolved(flat, offsets, values, scatter_jit.FLOAT, np.zeros(1, u))
        if sender and w in (2, 4):
            for want_run in (False, True):
                scan.scan_bits(np.zeros(32, u), np.ones(32, u), tables, 1, want_run)
        if sender and w <= 4:
            flags = np.zeros(1, np.uint8)
            ulp_jit.write_ulp_streams(values, np.ones(1, u), flags, flags.copy(), np.zeros((w, 1), np.uint8))
    return time.perf_counter() - start
