"""Compile every kernel before a first sync needs it: numba compiles on a signature's first call (11-17 s
cold, docs/results/kernels.md), so the engine's startup probe and `DeltaSender.seed` call `warm_up` with
the argument types a sync passes (tests/kernels/test_warmup.py: a sync after it compiles nothing)."""

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
    """Compile (or load from numba's cache) the digest's kernel and, with `engine`, the engine's
    (decode, scatter, read-back), with `sender` the sender's (scan, encode), for values of these
    dtypes (the model's parameters and checkpoint tensors); the seconds it took. Nothing with the
    kernels switched off."""
    if not switch.on():
        return 0.0
    start = time.perf_counter()
    widths = sorted({torch.empty(0, dtype=d).element_size() for d in dtypes} & _UINT.keys())
    from vllm_delta.kernels import digest_jit

    for w in widths:
        digest_jit.segment_sums(np.zeros(1, np.int64), np.zeros(1, _UINT[w]), np.zeros(1, np.int64), 0, 1)
    if engine:
        _engine(widths)
    if sender:
        _sender(widths)
    return time.perf_counter() - start


def _engine(widths: list[int]) -> None:
    from vllm_delta.kernels import params_jit, scatter_jit

    params_jit.scan(np.frombuffer(b"[]", dtype=np.uint8), params_jit.KEYS)  # a flush's params text
    for w in widths:
        u = _UINT[w]
        flat, offsets, values = np.zeros(2, u), np.zeros(1, np.int32), np.zeros(1, u)
        scatter_jit.write(flat, offsets, values)
        scatter_jit.mismatches(flat, offsets, values)
        if w <= 4:
            scatter_jit.write_resolved(flat, offsets, values, scatter_jit.FLOAT, np.zeros(1, u))


def _sender(widths: list[int]) -> None:
    from vllm_delta.kernels import scan, ulp_jit

    tables = tuple(np.array([v], np.int64) for v in (0, 32, 0, 0))
    for w in widths:
        u = _UINT[w]
        if w in (2, 4):
            for want_run in (False, True):
                scan.scan_bits(np.zeros(32, u), np.ones(32, u), tables, 1, want_run)
        if w <= 4:
            one = np.zeros(1, np.uint8)
            ulp_jit.write_ulp_streams(
                np.zeros(1, u), np.ones(1, u), one, one.copy(), np.zeros((w, 1), np.uint8)
            )
