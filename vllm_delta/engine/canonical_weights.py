"""Canonical (checkpoint-layout) weights of modules whose post-load step re-lays or derives them.

Why: a step may repack a weight (CPU oneDNN keeps its own packed copy and empties `layer.weight`;
fused MoE prepacks w13/w2) or derive tensors from it, which an in-place delta would never reach. For
a "rerun" module (`transforms`) deltas go to a checkpoint-layout copy of each parameter the step
changed, and the step is built again from it (`prebuild`, on a stand-in) or re-run in place
(`refresh`). An emptied parameter gets its canonical tensor back, so `/weight_checker` sees real
weights. `install_reload_hooks` makes vLLM's `reload_weights` load into the canonical tensors too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from vllm_delta.engine import derived, stand_in
from vllm_delta.engine.stand_in import Built, NotStandIn, held_tensors

STASH_ATTR = "_delta_canonical"  # {param name: checkpoint-layout tensor} on "rerun" modules
RESTORED_ATTR = "_delta_restored"  # param names whose canonical tensor is the live parameter


def post_load_step(module: nn.Module) -> Callable[[], None] | None:
    """The module's post-load step, as it can be run again after the first load.

    vLLM's unquantized fused MoE treats a second call as a weight update that skips its experts' own
    step (the CPU prepack): for it the re-run is both, in the first call's order.
    """
    method = getattr(module, "quant_method", None)
    step = getattr(method, "process_weights_after_loading", None)
    if step is None:
        return None
    if _skips_experts_on_update(method):

        def first_call_again() -> None:
            step(module)
            method.moe_kernel.fused_experts.process_weights_after_loading(module)

        return first_call_again
    return lambda: step(module)


def _skips_experts_on_update(method: object) -> bool:
    """Whether `method` is vLLM's unquantized fused MoE with its kernel built (its step is then an update)."""
    if getattr(method, "moe_kernel", None) is None:
        return False
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return isinstance(method, UnquantizedFusedMoEMethod)


def keep_canonical(
    module: nn.Module, canonical: dict[str, torch.Tensor], originals: dict[str, nn.Parameter]
) -> None:
    """Record a "rerun" module: checkpoint-layout copies of the params its step changed."""
    stash: dict[str, torch.Tensor] = {}
    restored: set[str] = set()
    for n, canon in canonical.items():
        live = module._parameters.get(n)
        if live is None or live.numel() == 0:
            # The original Parameter keeps its class and weight_loader; give it back its bytes.
            originals[n].data = canon
            module._parameters[n] = originals[n]
            restored.add(n)
        else:
            stash[n] = canon
    setattr(module, STASH_ATTR, stash)
    setattr(module, RESTORED_ATTR, restored)


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


def needs_refresh(module: nn.Module) -> bool:
    return hasattr(module, STASH_ATTR)


def prebuild(module: nn.Module, new: Mapping[str, torch.Tensor]) -> Built | None:
    """The module's post-load step run on a stand-in from the `new` canonical weights (param name ->
    tensor with the staged writes): copies into each stashed parameter and handler swaps (`cpu_linear`)
    for the commit. None where the step is not known to keep to its own layer (vLLM's linear, embedding
    and fp8 linear do) or moved another tensor: it is then re-run at commit (`refresh`).
    """
    if not _keeps_to_its_layer(module):
        return None
    restored: set[str] = getattr(module, RESTORED_ATTR, set())
    stash: dict[str, torch.Tensor] = getattr(module, STASH_ATTR)
    swap = {f"param:{n}": new[n] if n in new else c.clone() for n, c in stash.items()}
    swap.update({f"param:{n}": t for n, t in new.items()})
    kept = {
        k: swap.get(k, t) for k, (_, n, t) in held_tensors(module).items() if n not in restored | set(stash)
    }
    try:
        after, built, _ = stand_in.run(module, lambda m: post_load_step(m)(), swap)
    except NotStandIn:
        return None
    for n in stash:
        live, result = module._parameters[n].data, after.get(f"param:{n}", (0, 0, 0, None))[3]
        if result is None or result.shape != live.shape or result.dtype != live.dtype:
            return None
        built.copies.append((live, result.data))
    where = derived.location
    moved = [k for k, t in kept.items() if k not in after or where(after[k][3]) != where(t)]
    handlers = all(not isinstance(v, (torch.Tensor, nn.Module)) for _, _, v in built.swaps)
    return built if handlers and not moved else None


def _keeps_to_its_layer(module: nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:
        return False
    own_layer = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, Fp8LinearMethod)
    return type(getattr(module, "quant_method", None)) in own_layer


def refresh(modules: Iterable[nn.Module]) -> None:
    """Re-run the post-load step of touched modules from their canonical tensors, its results copied into
    the storage the engine reads (`derived.rederive`: every `data_ptr()` stays, RFC #48312). The step runs
    on copies of the canonical tensors: steps may write into the parameter they get (vLLM's fused MoE)."""
    for module in modules:
        stash: dict[str, torch.Tensor] = getattr(module, STASH_ATTR)
        inputs = {n: canon.clone() for n, canon in stash.items()}
        derived.rederive(module, lambda m: post_load_step(m)(), inputs=inputs)


def install_reload_hooks() -> None:
    """Make vLLM's layerwise in-place reload keep "rerun" modules' canonical tensors current."""
    from vllm.model_executor.model_loader.reload import layerwise

    if getattr(layerwise._layerwise_process, "_delta_wrapped", False):
        return
    process, copy_back = layerwise._layerwise_process, layerwise._copy_and_restore_kernel_tensors

    @functools.wraps(process)
    def process_from_canonical(layer: nn.Module, info) -> None:
        if info.kernel_tensors is None or not needs_refresh(layer):
            return process(layer, info)
        # vLLM's own step on the reloaded copy is skipped: the loaded values go to the canonical
        # tensors (below) and the step re-runs from there, exactly as after a delta.
        method = layer.quant_method
        method.process_weights_after_loading = lambda layer: None
        try:
            process(layer, info)
        finally:
            del method.process_weights_after_loading
        refresh([layer])

    @functools.wraps(copy_back)
    def copy_into_canonical(layer: nn.Module, info) -> None:
        if needs_refresh(layer):
            params, _ = info.kernel_tensors
            for n, canon in getattr(layer, STASH_ATTR).items():
                canon.copy_(getattr(layer, n))
                layer._parameters[n] = params[n]  # the live (processed) tensor is rebuilt by refresh
        copy_back(layer, info)

    process_from_canonical._delta_wrapped = True  # type: ignore[attr-defined]
    layerwise._layerwise_process = process_from_canonical
    layerwise._copy_and_restore_kernel_tensors = copy_into_canonical
