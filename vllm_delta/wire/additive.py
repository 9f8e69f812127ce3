"""Additive per-tensor digest H(t) = sum_i mix(i, bits_i) mod 2^64 in two lanes (terms: kernels/digest.py).
Why additive: a sender updates H in O(changed), shards add partial sums, a receiver checks what it will
overwrite. Not a MAC: tampering is the file hashes' and route auth's job."""

from __future__ import annotations

from typing import Final

import torch

from vllm_delta.kernels.digest import segment_sums

from .dtypes import by_torch

DIGEST_ALGO: Final = "add2x64-splitmix"
_M64 = (1 << 64) - 1


def partial_sum(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64[2] lane sums of the terms of `values` at flat `positions`, on their device
    (`kernels.digest` computes the terms)."""
    return segment_sums(positions, values, 0, 1)[0]


def check_positions(numel: int, dtype: torch.dtype) -> None:
    """Keys are injective only below 2^(64 - width) positions; refuse tensors beyond that."""
    width = 8 * by_torch(dtype).itemsize
    if width <= 32 and numel > 1 << (64 - width):
        raise ValueError(f"the additive digest covers at most 2^{64 - width} {dtype} elements, not {numel}")


def tensor_sum(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """H(t) over every element, in chunks so the temporaries stay a few chunk-sizes of int64."""
    flat = t.detach().reshape(-1)
    check_positions(flat.numel(), flat.dtype)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        total += partial_sum(torch.arange(start, start + part.numel(), device=flat.device), part)
    return total


def to_hex(lanes: torch.Tensor | tuple[int, int]) -> str:
    """32 hex digits, lane 0 first: how digests appear in manifests and replies."""
    a, b = (int(x) for x in (lanes.tolist() if isinstance(lanes, torch.Tensor) else lanes))
    return f"{a & _M64:016x}{b & _M64:016x}"


def from_hex(text: str) -> tuple[int, int]:
    if len(text) != 32:
        raise ValueError(f"an additive digest has 32 hex digits, not {len(text)}")
    return int(text[:16], 16), int(text[16:], 16)


def combine(*digests: str, minus: tuple[str, ...] = ()) -> str:
    """Sum (and difference) of hex digests mod 2^64 per lane: shards add, updates replace terms."""
    acc = [0, 0]
    for sign, group in ((1, digests), (-1, minus)):
        for d in group:
            for i, v in enumerate(from_hex(d)):
                acc[i] = (acc[i] + sign * v) & _M64
    return to_hex((acc[0], acc[1]))
