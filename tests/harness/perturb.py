"""Make a "trained" copy of a checkpoint: a few percent of elements moved by small ULP steps.

Why: apply tests need a NEW checkpoint that differs from BASE the way an Adam step at a small
learning rate does (mostly +-1 ULP, some larger moves), plus the awkward bit patterns (-0.0,
NaN payloads) that must round-trip exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def perturb_tensor(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """Move about `density` of the elements by small signed ULP steps (bitwise, on a copy)."""
    bits = t.contiguous().view(_INT[t.dtype]).clone().reshape(-1)
    n = bits.numel()
    k = max(1, int(n * density))
    pos = torch.randperm(n, generator=gen)[:k]
    steps = torch.randint(1, 3, (k,), generator=gen) * (torch.randint(0, 2, (k,), generator=gen) * 2 - 1)
    big = torch.rand(k, generator=gen) < 0.1
    steps[big] *= torch.randint(2, 40, (int(big.sum()),), generator=gen)
    bits[pos] = (bits[pos].to(torch.int64) + steps).to(bits.dtype)
    return bits.view(t.dtype).reshape(t.shape)


def perturb_checkpoint(base: Path, out: Path, density: float = 0.02, seed: int = 1) -> Path:
    """Copy `base` to `out` with every tensor perturbed (the same shard layout and other files)."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for path in base.iterdir():
        if path.suffix == ".safetensors":
            tensors = {name: perturb_tensor(t, density, gen) for name, t in load_file(path).items()}
            save_file(tensors, out / path.name, metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy2(path, out / path.name)
    return out
