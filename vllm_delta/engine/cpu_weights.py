"""CPU backend: keep the checkpoint-layout weights that vLLM repacks after loading.

Why: on the CPU, `process_weights_after_loading` hands linear layers to oneDNN / sgl kernels
that keep their own packed copy and replace `layer.weight` with an empty tensor, and fused MoE
replaces `w13_weight` / `w2_weight` with a VNNI-prepacked layout. An in-place delta written to
the original layout would never reach those kernels. With delta updates on (and only then, and
only on the CPU platform) we keep a canonical checkpoint-layout tensor for every parameter the
post-load step transforms, write deltas there, and re-run the layer's own post-load step for
the layers a delta touched. Parameters that were emptied get their canonical tensor back as the
live parameter, so vLLM's `/weight_checker` digests see real weights.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

STASH_ATTR = "_delta_canonical"  # {param name: checkpoint-layout tensor} on transformed modules
RESTORED_ATTR = "_delta_restored"  # param names whose canonical tensor is the live parameter


def install() -> None:
    """Wrap vLLM's post-load processing so transformed weights keep a canonical copy."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "_delta_wrapped", False):
        return

    @functools.wraps(original)
    def process_keeping_canonical(model: nn.Module, model_config, target_device) -> None:
        before = {
            name: {n: (p, p.detach().clone()) for n, p in module.named_parameters(recurse=False)}
            for name, module in model.named_modules()
            if getattr(module, "quant_method", None) is not None
        }
        original(model, model_config, target_device)
        kept = sum(_keep_canonical(model.get_submodule(name), clones) for name, clones in before.items())
        logger.info("delta updates (CPU): kept canonical weights of %d repacked layers", kept)

    process_keeping_canonical._delta_wrapped = True  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process_keeping_canonical


def _keep_canonical(module: nn.Module, clones: dict[str, tuple[nn.Parameter, torch.Tensor]]) -> bool:
    """Record which params the post-load step transformed; return whether any were."""
    stash: dict[str, torch.Tensor] = {}
    restored: set[str] = set()
    for n, (original, clone) in clones.items():
        live = module._parameters.get(n)
        if live is not None and live.shape == clone.shape and live.dtype == clone.dtype and torch.equal(live, clone):
            continue
        if live is None or live.numel() == 0:
            # The original Parameter keeps its class and weight_loader; give it back its bytes.
            original.data = clone
            module._parameters[n] = original
            restored.add(n)
        else:
            stash[n] = clone
    # Every layer with a post-load step is refreshed after a delta touches it, even when its
    # parameters look untouched: the step may keep a packed copy elsewhere (lm_head on CPU).
    setattr(module, STASH_ATTR, stash)
    setattr(module, RESTORED_ATTR, restored)
    return bool(stash or restored)


def canonical_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{param name: (live tensor, checkpoint-layout tensor that deltas are written into)}."""
    out = {}
    for name, module in model.named_modules():
        stash = getattr(module, STASH_ATTR, {})
        for n, live in module.named_parameters(recurse=False):
            full = f"{name}.{n}" if name else n
            if full not in out:
                out[full] = (live, stash.get(n, live))
    return out


def _rerun_post_load(module: nn.Module) -> None:
    """The layer's post-load step, as on first load.

    Fused MoE treats a second `process_weights_after_loading` as a weight update and skips its
    experts' CPU prepack (it copies the raw weights over the packed ones), so for MoE we run the
    experts' own step, which prepacks from the parameters we just restored.
    """
    kernel = getattr(module.quant_method, "moe_kernel", None)
    if kernel is not None:
        kernel.fused_experts.process_weights_after_loading(module)
    else:
        module.quant_method.process_weights_after_loading(module)


def transformed(model: nn.Module) -> list[str]:
    """Modules whose post-load step replaced or repacked a parameter (deltas go to a canonical copy)."""
    return [name for name, m in model.named_modules() if getattr(m, STASH_ATTR, None) or getattr(m, RESTORED_ATTR, None)]


def needs_refresh(module: nn.Module) -> bool:
    return hasattr(module, STASH_ATTR)


def refresh(modules: Iterable[nn.Module]) -> int:
    """Re-run the post-load step of touched layers from their canonical tensors."""
    count = 0
    for module in modules:
        stash: dict[str, torch.Tensor] = getattr(module, STASH_ATTR)
        restored: set[str] = getattr(module, RESTORED_ATTR)
        canon_live = {n: module._parameters[n] for n in restored}
        for n, canon in stash.items():
            module._parameters[n].data = canon.clone()
        _rerun_post_load(module)
        for n, param in canon_live.items():
            if module._parameters.get(n) is not param:
                module._parameters[n] = param
        count += 1
    return count
