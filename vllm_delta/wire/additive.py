"""Additive per-tensor digest: H(t) = sum_i mix(i, bits_i) mod 2^64, in two independent lanes.

Why additive: a sender that changes k elements updates H in O(k) (subtract the old terms, add the
new ones), ranks holding disjoint shards of one tensor add their partial sums, and a receiver can
check the k elements it is about to overwrite against the sender's expectation before writing
anything. xxh3 over the whole tensor (`tensor_digest`) can do none of these.

Everything is plain torch integer ops (int64 arithmetic wraps mod 2^64 on every backend), so the
terms are computed where the tensor lives and only the two 64-bit sums ever leave the device.

What it detects: any wrong value or wrong position among the summed elements, except with
probability about 2^-64 per lane for an adversary-free fault (the lanes use independent mixers,
so both must collide: ~2^-128). It is not a MAC: anyone who can write a delta can also write a
matching digest. Integrity against tampering comes from the file hashes and route auth.
"""

from __future__ import annotations

import torch

from .dtypes import by_torch

DIGEST_ALGO = "add2x64-splitmix"
_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's finaliser constants (lane 0) and Murmur3's fmix64 (lane 1).
_LANES = (
    (_i64(0x9E3779B97F4A7C15), (30, 27, 31), (_i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB))),
    (_i64(0xC2B2AE3D27D4EB4F), (33, 33, 33), (_i64(0xFF51AFD7ED558CCD), _i64(0xC4CEB9FE1A85EC53))),
)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor, shifts: tuple[int, int, int], mults: tuple[int, int]) -> torch.Tensor:
    x = (x ^ _shr(x, shifts[0])) * mults[0]
    x = (x ^ _shr(x, shifts[1])) * mults[1]
    return x ^ _shr(x, shifts[2])


def element_bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern, zero-extended to int64 (dtype-agnostic, no float arithmetic)."""
    d = by_torch(values.dtype)
    bits = values.detach().reshape(-1).view(d.int_view).to(torch.int64)
    return bits if d.itemsize == 8 else bits & ((1 << (8 * d.itemsize)) - 1)


def partial_sum(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64[2] lane sums of the terms of `values` at flat `positions`, on their device."""
    if positions.numel() != values.numel():
        raise ValueError(f"{positions.numel()} positions for {values.numel()} values")
    pos = positions.reshape(-1).to(torch.int64)
    bits = element_bits(values)
    lanes = []
    for golden, shifts, mults in _LANES:
        key = _mix(pos * golden + golden, shifts, mults)
        lanes.append(_mix(key ^ bits, shifts, mults).sum())
    return torch.stack(lanes)


def tensor_sum(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """H(t) over every element, in chunks so the temporaries stay a few chunk-sizes of int64."""
    flat = t.detach().reshape(-1)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
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
