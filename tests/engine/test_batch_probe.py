"""The batched placement probe (issue 16, item 2): many meta probes through one `load_weights` call.

Why: per-tensor probing paid the loader's per-call setup 46k times at 355B (7.6 ms a tensor on
GLM-4.7's shapes). A batch must map exactly what probing each tensor alone maps, and anything
it cannot prove - here a loader that scales the checkpoint tensor in place - must go back to
the per-tensor probe, which refuses it as before.
"""

from __future__ import annotations

import torch
from test_placement import CHECKPOINT, PackedModule, storages
from torch import nn

from vllm_delta.engine.probe import build_placement

N = 8


class Layers(nn.Module):
    """`n` layers of one row-sliced weight, and one loader that doubles its tensor in place first."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, N // 2, N), requires_grad=False)
        self.scaled = nn.Parameter(torch.zeros(N), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights) -> None:
        self.calls += 1
        for name, t in weights:
            if name == "scaled":
                t.mul_(2)  # in place on the checkpoint tensor: not a copy of it
                self.scaled.data.copy_(t)
            else:
                self.w.data[int(name.split(".")[1])].copy_(t.narrow(0, N // 2, N // 2))


def checkpoint(n: int) -> dict:
    return {**{f"layers.{i}.w": ((N, N), torch.float32) for i in range(n)}, "scaled": ((N,), torch.float32)}


def test_a_batch_maps_exactly_what_one_tensor_at_a_time_maps():
    for module, ckpt in ((PackedModule(), CHECKPOINT), (Layers(40), checkpoint(40))):
        one = build_placement(module.load_weights, storages(module), ckpt, batch=1)
        many = build_placement(module.load_weights, storages(module), ckpt, batch=16)
        assert many == one


def test_a_loader_writing_its_checkpoint_tensor_falls_back_and_the_rest_stay_batched():
    m = Layers(100)
    placements = build_placement(m.load_weights, storages(m), checkpoint(100), batch=1024)
    assert placements["scaled"].fallback_reason and not placements["scaled"].segments
    assert all(len(placements[f"layers.{i}.w"].segments) == 1 for i in range(100))
    # One rejected batch, the 100 layers before it as one, then "scaled" alone (fast + careful x2).
    assert m.calls <= 6
