"""A destination parameter the map reaches less of than it holds refuses updates at startup, named.

Why: the coverage check looks from the checkpoint's side, where a tensor no rank's loader reads is
"ignored" (as vLLM ignores rotary `inv_freq`). If the probe misses a loader's writes, a real tensor
becomes an ignored one and every delta to it is dropped while the commit answers ok. From the
parameters' side that is a destination the segments, fills and fallback replays reach too little of.
Here: loaders that write (all or half of) their parameter on the first load only, as vLLM's
reload wrapper does (after `reload_weights` its recorded loaders load nothing, so the probe that
follows sees no write), and a parameter no checkpoint tensor feeds; against them, a plain copy, a padded
parameter whose
padding the loader fills, a fallback whose replay writes its parameter, and a derived parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.placement import derived_params

H = 8


class Loaders(nn.Module):
    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.loads: dict[str, int] = {}
        for n in names:
            rows = H + 4 if n == "padded" else H
            self.register_parameter(
                n, nn.Parameter(torch.zeros(rows, H, dtype=torch.bfloat16), requires_grad=False)
            )

    def load_weights(self, weights) -> None:
        for name, w in weights:
            p = getattr(self, name.split(".")[0]).data
            first = self.loads.setdefault(name, 0) == 0
            self.loads[name] += 1
            if name == "gone.weight":  # loads once, then nothing
                if first:
                    p.copy_(w)
            elif name == "part.weight":  # its second half loads once, then nothing
                p[: H // 2].copy_(w[: H // 2])
                if first:
                    p[H // 2 :].copy_(w[H // 2 :])
            elif name == "padded.weight":  # vLLM's vocab padding: a constant fill of rows no element reaches
                p[:H].copy_(w)
                p[H:].fill_(0)
            elif name == "scaled.weight":  # a value transform: served by replaying the loader
                p.copy_(w * 2)
            else:
                p.copy_(w)


def applier(names: tuple[str, ...], checkpoint: tuple[str, ...]) -> DeltaApplier:
    gen = torch.Generator().manual_seed(0)
    ckpt = {f"{n}.weight": torch.randn(H, H, generator=gen).to(torch.bfloat16) for n in checkpoint}
    model = Loaders(names)
    model.load_weights(ckpt.items())
    return DeltaApplier(model, {n: ((H, H), torch.bfloat16) for n in ckpt}, read=lambda n: ckpt[n].clone())


def test_every_destination_reached_is_served():
    a = applier(("plain", "padded", "scaled"), ("plain", "padded", "scaled"))
    status = (a.placements, a.placement_status())[1]
    assert status["fallback"].keys() == {"scaled.weight"} and status["refused"] == {}, status


def test_loader_writes_the_probe_cannot_see_refuse_updates_naming_the_parameter():
    a = applier(("plain", "gone", "part"), ("plain", "gone", "part"))
    status = (a.placements, a.placement_status())[1]
    assert sorted(status["refused"]) == ["gone", "part"], status
    assert f"reaches 0 of its {H * H} elements" in status["refused"]["gone"]
    assert f"reaches {H * H // 2} of its {H * H} elements" in status["refused"]["part"]


def test_a_parameter_no_checkpoint_tensor_feeds_is_refused():
    a = applier(("plain", "orphan"), ("plain",))
    status = (a.placements, a.placement_status())[1]
    assert list(status["refused"]) == ["orphan"] and "reaches 0 of its" in status["refused"]["orphan"], status


def test_only_parameters_the_loader_says_it_loaded_are_held_to_it():
    """vLLM's models return the names they loaded: a parameter the checkpoint lacks keeps its default
    (fp8's `k_scale`) and is not refused; one the loader claims but the probe saw short still is."""

    class Claiming(Loaders):
        def load_weights(self, weights):
            weights = list(weights)
            super().load_weights(weights)
            return {name.split(".")[0] for name, _ in weights}

    gen = torch.Generator().manual_seed(0)
    ckpt = {f"{n}.weight": torch.randn(H, H, generator=gen).to(torch.bfloat16) for n in ("plain", "part")}
    model = Claiming(("plain", "part", "default"))
    model.load_weights(ckpt.items())
    a = DeltaApplier(model, {n: ((H, H), torch.bfloat16) for n in ckpt}, read=lambda n: ckpt[n].clone())
    status = (a.placements, a.placement_status())[1]
    assert list(status["refused"]) == ["part"], status


def test_derived_parameter_names():
    keys = [
        ("model.layers.0.attn", "param:W_UV"),
        ("model.layers.0.attn", "kv_b_proj.param:weight"),
        ("model.layers.0.attn", "impl.attr:_w_uk_packed"),
        ("", "param:lm_head_sum"),
    ]
    assert derived_params(keys) == {
        "model.layers.0.attn.W_UV",
        "model.layers.0.attn.kv_b_proj.weight",
        "lm_head_sum",
    }
