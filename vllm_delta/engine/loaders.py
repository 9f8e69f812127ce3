"""The model's own loaders for parameters a post-load step replaced, so the probe can replay them.

Why: vLLM's block-fp8, Marlin and GPTQ methods `replace_parameter` after loading, dropping the
model-format class and its `weight_loader`. vLLM records each layer's model-format parameters (on
`meta`) for `reload_weights`; `model_format` registers, for each call, stand-ins with that class and
those attributes around the live tensor's data. Exact only where the live tensor kept the recorded
layout; elsewhere the stand-in's loader raises `ReplacedLayout` and the tensor is refused at startup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


class ReplacedLayout(RuntimeError):
    """A replaced parameter whose live layout is not its model-format one: no loader addresses it."""


@dataclass(frozen=True)
class _Replaced:
    module: nn.Module
    name: str
    stand_in: torch.Tensor


def _recorded(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's model-format parameters as vLLM recorded them at construction (meta), or {} (read
    only if vLLM's module is loaded: a synthetic model needs no import of vLLM)."""
    layerwise = sys.modules.get("vllm.model_executor.model_loader.reload.layerwise")
    info = None if layerwise is None else layerwise.LAYERWISE_INFO.get(module)
    return {} if info is None else info.restore_metadata[0]


def _model_format(recorded: torch.Tensor) -> dict[str, object]:
    """The recorded attributes, loaders unwrapped (a `reload_weights` wraps them in `online_process_loader`,
    which loads nothing outside a reload)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    attrs = dict(vars(recorded))
    for key in ("weight_loader", "_weight_loader"):  # BasevLLMParameter keeps it as `_weight_loader`
        loader = attrs.get(key)
        while getattr(loader, "__name__", None) == "online_process_loader":
            loader = loader.__wrapped__
        if key in attrs:
            attrs[key] = loader
    if attrs.get("weight_loader") is default_weight_loader:
        del attrs["weight_loader"]  # the wrap added it where the model loads with the default
    return attrs


def _lost_format(live: torch.Tensor, recorded: torch.Tensor, attrs: dict[str, object]) -> bool:
    """Whether the live parameter lost its model-format class or its loader (what `replace_parameter`
    drops); one that kept both is loaded as it is."""
    lost_loader = "weight_loader" in attrs and "weight_loader" not in vars(live)
    return type(live) is not type(recorded) or lost_loader


def _stand_in(
    module_name: str,
    name: str,
    module: nn.Module,
    live: torch.Tensor,
    recorded: torch.Tensor,
    attrs: dict[str, object],
) -> torch.Tensor:
    """The recorded class and attributes around `live`'s data, or a plain one whose loader refuses."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    same = (live.shape, live.stride(), live.dtype) == (recorded.shape, recorded.stride(), recorded.dtype)
    t = live.data.detach()
    if not same:
        why = (
            f"{module_name}: its post-load step replaced {name}, model format {tuple(recorded.shape)} "
            f"{recorded.stride()} {recorded.dtype}, served as {tuple(live.shape)} {live.stride()} "
            f"{live.dtype}: no loader addresses the served layout"
        )

        def refuse(*args, **kwargs):
            raise ReplacedLayout(why)

        t = nn.Parameter(t, requires_grad=False)
        t.weight_loader = refuse
        return t
    t.__class__ = type(recorded)  # as vLLM's own `reload/meta.py` rebuilds model-format tensors
    t.__dict__ = attrs
    return restore_layer_refs(t, module)


def replaced(model: nn.Module) -> list[_Replaced]:
    """Every live parameter that lost its model format, with its stand-in."""
    out = []
    for module_name, module in model.named_modules():
        recorded = _recorded(module)
        for name, live in module._parameters.items():
            rec = recorded.get(name)
            if live is None or rec is None:
                continue
            attrs = _model_format(rec)
            if _lost_format(live, rec, attrs):
                out.append(_Replaced(module, name, _stand_in(module_name, name, module, live, rec, attrs)))
    return out


def model_format(model: nn.Module, load_weights: LoadWeights | None = None) -> LoadWeights:
    """`load_weights` (the model's own by default) run with model-format stand-ins in place, found once
    and kept while the live objects they stand for are still registered (a call costs O(replaced), not a
    walk of the model: a fallback's replay calls it in every prepare)."""
    load = load_weights or model.load_weights
    found: list[_Replaced] | None = None
    live: list[torch.Tensor] = []

    def load_in_model_format(weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        nonlocal found, live
        if found is None or any(r.module._parameters.get(r.name) is not p for r, p in zip(found, live)):
            found = replaced(model)
            live = [r.module._parameters[r.name] for r in found]
        for r in found:  # the stand-ins registered for the call, then the live parameters again
            r.module._parameters[r.name] = r.stand_in
        try:
            return load(weights)
        finally:
            for r, param in zip(found, live):
                r.module._parameters[r.name] = param

    return load_in_model_format
