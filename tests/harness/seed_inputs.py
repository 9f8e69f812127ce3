"""Fixed inputs for the seed-format byte pins (tests/integrations/test_seed_flush_bytes.py).

Two chunks of (name, old, new), as the seed's trainer diffs them: a bf16 matrix and an fp32 norm
in one chunk (their values concatenate to fp32, as the seed's did), and a long bf16 vector whose
two changes lie more than 65535 apart (a uint32 gap run), plus an unchanged tensor.
"""

from __future__ import annotations

import torch


def seed_case() -> list[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(31)
    w_old = (torch.randn(64, 48, generator=g) * 0.02).bfloat16()
    w_new = w_old.clone()
    moved = torch.rand(w_old.shape, generator=g) < 0.03
    w_new.view(torch.int16)[moved] += 1
    norm_old = torch.ones(48)
    norm_new = norm_old.clone()
    norm_new[[0, 47]] = torch.tensor([1.25, -0.5])
    big_old = (torch.randn(70_000, generator=g) * 0.02).bfloat16()
    big_new = big_old.clone()
    big_new[[5, 69_990]] = torch.tensor([0.5, -0.0]).bfloat16()
    same = torch.randn(16, generator=g).bfloat16()
    return [
        [("model.layers.0.mlp.w", w_old, w_new), ("model.norm.weight", norm_old, norm_new)],
        [("model.big", big_old, big_new), ("model.same", same, same.clone())],
    ]
