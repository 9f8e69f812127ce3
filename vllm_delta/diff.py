"""Bitwise diff of a param against its snapshot: no float arithmetic, dtype-agnostic.

`+0.0` vs `-0.0` and differing NaN payloads are changes; equal bits are not, even for NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_delta.wire.dtypes import by_torch

# Compare in chunks so the boolean mask never costs more than this many bytes.
CHUNK_ELEMENTS = 1 << 26


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
    parts = [torch.nonzero(a[i:i + CHUNK_ELEMENTS] != b[i:i + CHUNK_ELEMENTS]).reshape(-1) + i
             for i in range(0, a.numel(), CHUNK_ELEMENTS)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=current.device)


def diff_param(current: torch.Tensor, snapshot: torch.Tensor) -> ParamDiff:
    """Changed positions with the new and old values there (the snapshot is not modified)."""
    pos = changed_positions(current, snapshot)
    return ParamDiff(pos, current.detach().reshape(-1)[pos], snapshot.detach().reshape(-1)[pos])
