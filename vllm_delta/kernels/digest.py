"""The additive digest's terms and their sums per segment (`segment_sums`: the one entry point of every
digest), H(t) = sum_i mix(key(i, bits_i)) mod 2^64 in two lanes (wire/additive.py says why): compiled
(`digest_jit`) on CPU tensors, else torch int64 ops where the values live, so only the sums leave it."""

from __future__ import annotations

import numpy as np
import torch

from vllm_delta.kernels import switch
from vllm_delta.kernels.lanes import LANES

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# On the CPU (kernels off), terms are summed this many at a time: the ~30 elementwise passes then run on
# int64 temporaries that stay in cache, ~3x faster than whole-array passes (a sum mod 2^64 does not
# depend on the grouping). A GPU takes the whole array at once.
CPU_SLICE = 1 << 15


def mix_(x: torch.Tensor, lane: int) -> torch.Tensor:
    """A lane's 64-bit finaliser (a bijection), in place; `>>` on int64 is arithmetic, so masked."""
    _, shifts, mults = LANES[lane]
    for i, k in enumerate(shifts):
        t = x >> k
        t &= (1 << (64 - k)) - 1
        x ^= t
        if i < 2:
            x *= mults[i]
    return x


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat unsigned numpy view of a CPU tensor (no copy): what the kernels take."""
    size = t.element_size()
    return t.detach().reshape(-1).view(_INT[size]).numpy().view(f"u{size}")


def keys(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One int64 key per element, injective in (position, bits) up to 32-bit dtypes: position * 2^width
    + bits (zero-extended); 64-bit dtypes key on a mix of the position XOR the bits."""
    size = values.element_size()
    pos = positions.reshape(-1).to(torch.int64)
    bits = values.detach().reshape(-1).view(_INT[size]).to(torch.int64)
    if size < 8:
        bits &= (1 << (8 * size)) - 1
        return (pos << (8 * size)).bitwise_or_(bits)
    golden = LANES[0][0]
    return mix_(pos * golden + golden, 0).bitwise_xor_(bits)


def segment_sums(
    positions: torch.Tensor, values: torch.Tensor, segments: torch.Tensor | int, n: int
) -> torch.Tensor:
    """int64[n, 2]: per segment, the two lane sums of the terms of `values` at flat `positions`, on
    their device. `segments[i]` is entry i's segment in [0, n), or one int for every entry."""
    count = positions.numel()
    if count != values.numel():
        raise ValueError(f"{count} positions for {values.numel()} values")
    cpu = values.device.type == positions.device.type == "cpu"
    if switch.on() and cpu and (isinstance(segments, int) or segments.device.type == "cpu"):
        from vllm_delta.kernels import digest_jit

        if isinstance(segments, int):  # the kernel checks it lies in [0, n)
            seg, one = digest_jit.NO_SEGMENTS, segments
        else:
            seg, one = segments.detach().reshape(-1).to(torch.int64).numpy(), 0
        pos = positions.detach().reshape(-1).to(torch.int64).numpy()
        return torch.from_numpy(digest_jit.segment_sums(pos, bits(values), seg, one, n).view("i8"))
    out = torch.zeros(n, 2, dtype=torch.int64, device=values.device)
    step = CPU_SLICE if values.device.type == "cpu" else max(1, count)
    positions, values = positions.reshape(-1), values.reshape(-1)
    for lo in range(0, count, step):
        key = keys(positions[lo : lo + step], values[lo : lo + step])
        lane1 = mix_(key ^ LANES[1][0], 1)
        lane0 = mix_(key, 0)
        if isinstance(segments, int):
            out[segments] += torch.stack([lane0.sum(), lane1.sum()])
        else:
            out.index_add_(0, segments.reshape(-1)[lo : lo + step], torch.stack([lane0, lane1], 1))
    return out
