"""Parameters a post-load step replaced (vLLM's `replace_parameter`) are probed through their model format.

Why: vLLM's block-fp8 (CPU and GPU), Marlin and GPTQ methods re-register their weights as plain
`Parameter`s after loading; the class that slices a TP shard (`ModelWeightParameter`,
`BlockQuantScaleParameter`) and its `weight_loader` are gone, so the probe's replay raised, or, where
the model falls back to `default_weight_loader`, would copy a whole tensor where the real loader
slices it. `engine/loaders.py` stands vLLM's recorded model-format tensors in for the duration of a
loader call. Here a module shaped like vLLM's fp8 linear layer at TP rank 1 of 2 (the loader
slices columns in its Parameter class) is recorded by vLLM's own `record_metadata_for_reloading`
and replaced by vLLM's own `replace_parameter`; the real engine is tests/engine/test_fp8_served.py.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.placement import Segment

N, K, RANK, TP = 256, 512, 1, 2
FP8 = torch.float8_e4m3fn


class Sharded(nn.Parameter):
    """Like vLLM's `ModelWeightParameter`: the TP slicing lives on the parameter's class."""

    def load_row_parallel_weight(self, w: torch.Tensor) -> None:
        shard = self.data.shape[1]
        self.data.copy_(w.narrow(1, RANK * shard, shard))


class Fp8Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape, dtype in (
            ("weight", (N, K // TP), FP8),
            ("weight_scale_inv", (N // 128, K // TP // 128), torch.float32),
        ):
            p = Sharded(torch.zeros(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = self.weight_loader  # a bound method, as vLLM's layers give theirs
            self.register_parameter(name, p)

    def weight_loader(self, param: Sharded, w: torch.Tensor) -> None:
        param.load_row_parallel_weight(w)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Fp8Linear()

    def load_weights(self, weights) -> None:  # as vLLM's models do
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, w in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, w)


def checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(N, K, generator=g).to(FP8),
        "proj.weight_scale_inv": torch.rand(N // 128, K // 128, generator=g),
    }


def served(relayout=lambda w: w.view(torch.uint8).flip(1).view(FP8)) -> tuple[Model, dict[str, torch.Tensor]]:
    """Built and recorded by vLLM, loaded, then replaced as the CPU fp8 kernel does (the weight re-laid
    within its shape by default, the scale re-wrapped around its own bytes)."""
    from vllm.model_executor.layers.quantization.utils import replace_parameter
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    model = Model()
    record_metadata_for_reloading(model)
    ckpt = checkpoint()
    model.load_weights(ckpt.items())
    replace_parameter(
        model.proj, "weight", nn.Parameter(relayout(model.proj.weight.data), requires_grad=False)
    )
    replace_parameter(
        model.proj,
        "weight_scale_inv",
        nn.Parameter(model.proj.weight_scale_inv.data.contiguous(), requires_grad=False),
    )
    assert type(model.proj.weight) is nn.Parameter and not hasattr(model.proj.weight, "weight_loader")
    return model, ckpt


def applier(model: Model, ckpt: dict[str, torch.Tensor], **kwargs) -> DeltaApplier:
    return DeltaApplier(
        model,
        {n: (tuple(t.shape), t.dtype) for n, t in ckpt.items()},
        read=lambda n: ckpt[n].clone(),
        **kwargs,
    )


def test_replaced_parameters_are_probed_with_their_model_format_loaders():
    model, ckpt = served()
    live = dict(model.named_parameters())
    a = applier(model, ckpt)
    placements = a.placements
    assert a.refused == {} and a.fallback_tensors == {}
    # Rank 1's half of the columns, as the Parameter class slices them (a default loader copies all).
    shard = K // TP
    assert placements["proj.weight"].segments == [
        Segment("proj.weight", (N, shard), shard, (K, 1), 0, (shard, 1))
    ]
    cols = shard // 128
    assert placements["proj.weight_scale_inv"].segments == [
        Segment("proj.weight_scale_inv", (N // 128, cols), cols, (K // 128, 1), 0, (cols, 1))
    ]
    assert dict(model.named_parameters()) == live  # the live objects are back


def test_without_the_model_format_the_replaced_loaders_are_refused():
    """The mutation this guards against: the probe given the live (replaced) parameters."""
    model, ckpt = served()
    a = applier(model, ckpt, load_weights=model.load_weights)
    _ = a.placements
    assert sorted(a.refused) == ["proj.weight", "proj.weight_scale_inv"]


def test_loaders_wrapped_by_a_reload_are_unwrapped():
    """vLLM's `reload_weights` registers the recorded tensors themselves and wraps their loaders in an
    `online_process_loader`, which loads nothing once the reload is over: a stand-in must not carry it."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    model, ckpt = served()
    layer, live = model.proj, dict(model.proj._parameters)
    info = get_layerwise_info(layer)
    restore_layer_on_meta(layer, info)  # what initialize_layerwise_reload does to each layer...
    initialize_online_processing(layer)
    assert info.restore_metadata[0]["weight"].weight_loader.__name__ == "online_process_loader"
    layer._parameters.update(live)  # ... and what the reload leaves: the kernel tensors back, the info reset
    info.reset()
    a = applier(model, ckpt)
    placements = a.placements
    assert a.refused == {} and all(p.read and p.segments for p in placements.values()), placements


def test_a_replaced_parameter_whose_layout_changed_is_refused_at_startup_naming_the_module():
    model, ckpt = served(relayout=lambda w: w.t())  # as Marlin's (K, N) canonicalization
    a = applier(model, ckpt)
    _ = a.placements  # the startup probe (the route runs it in the background)
    status = a.placement_status()
    assert sorted(status["refused"]) == ["proj.weight"], status["refused"]
    why = status["refused"]["proj.weight"]
    assert "ReplacedLayout" in why and "proj: its post-load step replaced weight" in why, why
    assert "(256, 1) torch.float8_e4m3fn, served as (256, 256) (1, 256)" in why, why  # the strides differ
