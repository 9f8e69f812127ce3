"""Bitwise diff of a param against its snapshot: no float arithmetic, dtype-agnostic.

`+0.0` vs `-0.0` and differing NaN payloads are changes; equal bits are not, even for NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_delta.wire.dtypes import by_torch

# Compare in chunks small enough that the boolean mask is reused from the allocator's free list
# instead of being mapped (and page-faulted) afresh: 2-3x faster than one large mask on CPU.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True, eq=False)
class ParamDiff:
    positions: torch.Tensor  # int64 flat positions, sorted
    new_values: torch.Tensor  # current values there, own dtype
    old_values: torch.Tensor  # snapshot values there, own dtype

    @property
    def count(self) -> int:
        return self.positions.numel()


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat same-width signed-integer view of a tensor's bits."""
    return t.detach().reshape(-1).view(by_torch(t.dtype).int_view)


def changed_positions(current: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat positions where the bit patterns differ."""
    if current.shape != snapshot.shape or current.dtype != snapshot.dtype:
        raise ValueError(f"shape/dtype differ: {current.dtype}{list(current.shape)} vs "
                         f"{snapshot.dtype}{list(snapshot.shape)}")
    a, b = int_view(current), int_view(snapshot)
    if a.device.type != "cpu":  # on an accelerator the mask stays on the device
        return torch.nonzero(a != b).reshape(-1)
    an, bn = a.numpy(), b.numpy()
    parts = [np.flatnonzero(an[i:i + CHUNK_ELEMENTS] != bn[i:i + CHUNK_ELEMENTS]) + i
             for i in range(0, an.size, CHUNK_ELEMENTS)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)) if parts else \
        torch.zeros(0, dtype=torch.int64)


def diff_param(current: torch.Tensor, snapshot: torch.Tensor) -> ParamDiff:
    """Changed positions with the new and old values there (the snapshot is not modified)."""
    pos = changed_positions(current, snapshot)
    return ParamDiff(pos, current.detach().reshape(-1)[pos], snapshot.detach().reshape(-1)[pos])
