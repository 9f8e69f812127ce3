"""A loader that fails outright is refused at startup, naming the tensor, not found in a prepare.

Why: vLLM's block-fp8, Marlin and GPTQ methods call `replace_parameter`, which turns a
`ModelWeightParameter` into a plain `Parameter`; its `weight_loader_v2` then raises
`AttributeError` when replayed. Only `UnservableLoader` was caught, so planning aborted, `/health`
stayed green and every prepare failed with a KeyError. Here a module's loader reads an attribute
its parameter no longer has, as after `replace_parameter`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_delta.engine.apply import DeltaApplier

H = 8


class Replaced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Parameter(torch.zeros(H, H, dtype=torch.bfloat16), requires_grad=False)
        self.replaced = nn.Parameter(torch.zeros(H, H, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, w in weights:
            param = getattr(self, name.split(".")[0])
            if name == "replaced.weight":
                param.data[:, : param.output_dim] = w  # a plain Parameter has no output_dim any more
            else:
                param.data.copy_(w)


def test_a_loader_that_raises_on_replay_is_refused_at_startup():
    ckpt = {n: torch.randn(H, H).to(torch.bfloat16) for n in ("plain.weight", "replaced.weight")}
    model = Replaced()
    model.plain.data.copy_(ckpt["plain.weight"])
    model.replaced.data.copy_(ckpt["replaced.weight"])
    applier = DeltaApplier(model, {n: ((H, H), torch.bfloat16) for n in ckpt}, read=lambda n: ckpt[n].clone())
    _ = applier.placements  # the probe runs at startup (lazily here)
    status = applier.placement_status()
    assert list(status["refused"]) == ["replaced.weight"], status
    assert "AttributeError" in status["refused"]["replaced.weight"]
    assert "plain.weight" not in status["fallback"]
