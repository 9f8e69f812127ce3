"""Bitwise diff of a param against its snapshot (`+0.0` vs `-0.0` and NaN payloads are changes), where the
tensors live: torch ops on an accelerator, numpy over chunks on every CPU core on the host."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from vllm_delta.wire.dtypes import by_torch

# Compare in chunks small enough that the boolean mask is reused from the allocator's free list
# instead of being mapped (and page-faulted) afresh: 2-3x faster than one large mask on CPU.
CHUNK_ELEMENTS = 1 << 22


@functools.cache
def _cpu_pool() -> ThreadPoolExecutor:
    """numpy releases the GIL in comparisons and flatnonzero, so threads use every core."""
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="vllm-delta-diff")


@dataclass(frozen=True, eq=False)
class ParamDiff:
    positions: torch.Tensor  # int64 flat positions, sorted
    new_values: torch.Tensor  # current values there, own dtype
    old_values: torch.Tensor  # snapshot values there, own dtype


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat same-width signed-integer view of a tensor's bits."""
    return t.detach().reshape(-1).view(by_torch(t.dtype).int_view)


def changed_positions(current: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat positions where the bit patterns differ, on the tensors' device."""
    if current.shape != snapshot.shape or current.dtype != snapshot.dtype:
        got, snap = f"{current.dtype}{list(current.shape)}", f"{snapshot.dtype}{list(snapshot.shape)}"
        raise ValueError(f"shape/dtype differ: {got} vs {snap}")
    a, b = int_view(current), int_view(snapshot)
    if a.device.type != "cpu":  # on an accelerator (or meta) the mask and positions stay there
        return device_positions(a, b)
    an, bn = a.numpy(), b.numpy()

    def chunk(i: int) -> np.ndarray:
        return np.flatnonzero(an[i : i + CHUNK_ELEMENTS] != bn[i : i + CHUNK_ELEMENTS]) + i

    starts = range(0, an.size, CHUNK_ELEMENTS)
    threaded = len(starts) > 1 and os.cpu_count() != 1
    parts = list(_cpu_pool().map(chunk, starts)) if threaded else [chunk(i) for i in starts]
    return torch.from_numpy(np.concatenate([np.empty(0, np.int64), *parts]).astype(np.int64, copy=False))


def device_positions(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The accelerator diff of two int views: torch ops only, so nothing leaves their device.
    A function of its own so that tests can run it on the CPU and check it element for element."""
    return torch.nonzero(a != b).reshape(-1)


def diff_param(current: torch.Tensor, snapshot: torch.Tensor) -> ParamDiff:
    """Changed positions with the new and old values there (the snapshot is not modified)."""
    pos = changed_positions(current, snapshot)
    return ParamDiff(pos, current.detach().reshape(-1)[pos], snapshot.detach().reshape(-1)[pos])
