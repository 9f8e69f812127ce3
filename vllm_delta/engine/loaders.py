"""Loaders for parameters a post-load step replaced (vLLM's fp8/Marlin/GPTQ `replace_parameter` drops
the model format's class and `weight_loader`): stand-ins with the class and attributes vLLM recorded for
`reload_weights`, around the live data; a changed layout's loader raises `ReplacedLayout`."""

from __future__ import annotations

import sys

import torch
from torch import nn

from vllm_delta.engine.intercept import LoadWeights


class ReplacedLayout(RuntimeError):
    """A replaced parameter whose live layout is not its model-format one: no loader addresses it."""


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


def _stand_in(
    module_name: str, name: str, module: nn.Module, live: torch.Tensor, recorded: torch.Tensor
) -> torch.Tensor | None:
    """The recorded class and attributes around `live`'s data, a plain one whose loader refuses (layout
    changed), or None where `live` kept its model-format class and loader (it loads as it is)."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    attrs = _model_format(recorded)
    if type(live) is type(recorded) and ("weight_loader" not in attrs or "weight_loader" in vars(live)):
        return None
    t = live.data.detach()
    if (live.shape, live.stride(), live.dtype) != (recorded.shape, recorded.stride(), recorded.dtype):
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


def replaced(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, stand-in) for every live parameter that lost its model format (read only where
    vLLM's module is loaded: a synthetic model needs no import of vLLM)."""
    layerwise = sys.modules.get("vllm.model_executor.model_loader.reload.layerwise")
    out = []
    for module_name, module in model.named_modules():
        info = None if layerwise is None else layerwise.LAYERWISE_INFO.get(module)
        recorded = {} if info is None else info.restore_metadata[0]
        for name, live in module._parameters.items():
            if live is not None and (rec := recorded.get(name)) is not None:
                if (t := _stand_in(module_name, name, module, live, rec)) is not None:
                    out.append((module, name, t))
    return out


def model_format(model: nn.Module) -> LoadWeights:
    """The model's `load_weights` run with the stand-ins in place, found once and kept while the live
    parameters are registered (a fallback's replay calls it in every prepare)."""
    load = model.load_weights
    found: list[tuple[nn.Module, str, torch.Tensor]] | None = None
    live: list[torch.Tensor] = []

    def load_in_model_format(weights):
        nonlocal found, live
        if found is None or any(m._parameters.get(n) is not p for (m, n, _), p in zip(found, live)):
            found = replaced(model)
            live = [m._parameters[n] for m, n, _ in found]
        for module, name, stand_in in found:  # the stand-ins registered for the call, then the live again
            module._parameters[name] = stand_in
        try:
            return load(weights)
        finally:
            for (module, name, _), param in zip(found, live):
                module._parameters[name] = param

    return load_in_model_format
