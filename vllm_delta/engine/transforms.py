"""Quant methods' post-load steps, classified as vLLM runs them (`install`): unchanged; `permutation`
(deltas go through the inverse `OffsetMap`); `rerun` (deltas go to checkpoint-layout copies, a
`derived.Unit` re-runs it); else `UnsupportedTransform`. Why: the probe sees `load_weights`, not the step
after it, which may swap a fused w13's halves or re-pack a weight where no delta reaches."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine import derived
from vllm_delta.engine.derived import Step, Unit
from vllm_delta.engine.stand_in import held_tensors, same_bits

TRANSFORM_ATTR = "_delta_transform"  # the module's `Transform`


class UnsupportedTransform(RuntimeError):
    """A post-load step that is neither a permutation nor reproducible from the checkpoint layout."""


@dataclass
class Transform:
    """What a module's post-load step did, and how deltas reach its weights."""

    kind: str  # "permutation" | "rerun"
    changed: list[str] = field(default_factory=list)  # parameters whose bits changed
    derived: list[str] = field(default_factory=list)  # other tensors the step added or changed
    # permutation: param name -> inverse map (loaded position -> position after the step), start 0
    inverse: dict[str, OffsetMap] = field(default_factory=dict)
    # rerun: the step, re-run after a delta (a weak reference: the unit holds the module, the model holds it)
    unit: Callable[[], Unit | None] | None = None


@dataclass(frozen=True)
class OffsetMap:
    """Where a permuting step moved a parameter's elements: loaded storage offset -> live one. One entry a
    row where it moves whole rows (an int32 an element would be twice a bf16 weight), else an element."""

    start: int  # the parameter's storage offset
    table: torch.Tensor  # loaded row -> live row (int32 below 2**31 rows)
    row_len: int = 1

    @property
    def numel(self) -> int:
        return self.table.numel() * self.row_len

    def live(self, offsets: torch.Tensor) -> torch.Tensor:
        """Storage offsets in the loaded layout -> where the step moved those elements."""
        local = offsets.to(self.table.device, non_blocking=True) - self.start
        if self.row_len == 1:
            return self.table[local].to(offsets.dtype) + self.start
        rows = torch.div(local, self.row_len, rounding_mode="floor")
        return self.table[rows].to(offsets.dtype) * self.row_len + (local - rows * self.row_len) + self.start

    def loaded(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of the flat storage `flat` with this parameter back in its loaded layout."""
        out = flat.clone()
        span = slice(self.start, self.start + self.numel)
        out[span].view(-1, self.row_len).copy_(flat[span].view(-1, self.row_len).index_select(0, self.table))
        return out


def _compact(perm: torch.Tensor, row_len: int) -> OffsetMap:
    """The inverse of `perm` (`perm[i]`: the loaded flat index the step put at i), per row where it moves
    whole rows (each row a run of consecutive loaded elements)."""
    rows = perm.view(-1, row_len) if row_len > 1 else None
    whole_rows = rows is not None and torch.equal(
        rows - rows[:, :1], torch.arange(row_len, device=perm.device).expand_as(rows)
    )
    if whole_rows:
        perm = torch.div(rows[:, 0], row_len, rounding_mode="floor")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), dtype=torch.int64, device=perm.device)
    return OffsetMap(
        0, inverse.to(torch.int32) if perm.numel() < 1 << 31 else inverse, row_len if whole_rows else 1
    )


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the module holds itself (`stand_in.held_tensors`), parameters detached."""
    return {k: t.detach() if kind == "param" else t for k, (kind, _, t) in held_tensors(module).items()}


def _state(module: nn.Module) -> dict[str, int]:
    """Public non-tensor attributes by identity: a step that sets one may hide a weight copy in it."""
    return {n: id(v) for n, v in vars(module).items() if n[0] != "_" and not isinstance(v, torch.Tensor)}


def run_step(module: nn.Module) -> None:
    """The module's post-load step again (its class's, under any observer). vLLM's unquantized fused MoE
    treats a second call as a weight update that skips its experts' own step (the CPU prepack): both run."""
    method = module.quant_method
    update = getattr(method, "moe_kernel", None) is not None  # its kernel built: the step is an update
    type(method).process_weights_after_loading(method, module)
    if update:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe

        if isinstance(method, moe.UnquantizedFusedMoEMethod):
            method.moe_kernel.fused_experts.process_weights_after_loading(module)


def _rerun(module: nn.Module, params: dict[str, nn.Parameter], tensors: dict, changed: list[str]) -> None:
    """The step again, from the checkpoint-layout values of `changed` in their original Parameters."""
    for n in changed:
        params[n].data = tensors[f"param:{n}"].clone()
        module._parameters[n] = params[n]
    run_step(module)


def _inverse_permutation(
    module: nn.Module, name: str, before: torch.Tensor, after: torch.Tensor
) -> OffsetMap | None:
    """Inverse map of a step that permutes parameter `name` (run on its element ids, float64), or None.
    The caller restores the module."""
    if before.shape != after.shape or before.dtype != after.dtype or not after.is_contiguous():
        return None
    n = before.numel()
    module._parameters[name].data = torch.arange(n, dtype=torch.float64, device=before.device).view(
        before.shape
    )
    try:
        run_step(module)
    except Exception:
        return None
    ids = module._parameters.get(name)
    if ids is None or ids.dtype != torch.float64 or ids.shape != before.shape:
        return None
    perm = ids.detach().reshape(-1)
    if not torch.equal(perm.sort().values, torch.arange(n, dtype=torch.float64, device=perm.device)):
        return None
    perm = perm.to(torch.int64)
    if not same_bits(after.reshape(-1), before.reshape(-1)[perm]):  # the real bits moved the same way
        return None
    return _compact(perm, after.shape[-1] if after.dim() else 1)


def classify(name: str, module: nn.Module, step: Step, units: list[Unit]) -> Transform | None:
    """Run the step, classify what it did to `module` and prepare deltas for it (a "rerun" module's unit
    appended to `units`)."""
    tensors = {k: t.clone() for k, t in _tensors(module).items()}
    params, state_before = dict(module.named_parameters(recurse=False)), _state(module)
    step(module)
    after = {k: t.clone() for k, t in _tensors(module).items()}
    differs = sorted(k for k in tensors.keys() | after.keys() if not same_bits(tensors.get(k), after.get(k)))
    now = _state(module)
    state = sorted(n for n in now if state_before.get(n) != now[n])
    if not differs and not state:
        return None
    changed = [k.split(":", 1)[1] for k in differs if k.startswith("param:") and k in tensors]
    made = [k for k in differs if k not in tensors or not k.startswith("param:")]
    # A step may consume parameters (fp8 KV-cache scales folded into `_k_scale`): never a permutation.
    consumed = [n for n in changed if f"param:{n}" not in after]
    inverse: dict[str, OffsetMap | None] = {}
    try:
        for n in changed if not made and not state and not consumed else []:
            inverse[n] = _inverse_permutation(module, n, tensors[f"param:{n}"], after[f"param:{n}"])
            _rerun(module, params, tensors, changed)  # back from the id probe
            if inverse[n] is None:
                break
        if not inverse:
            _rerun(module, params, tensors, changed)
    except Exception as exc:
        raise UnsupportedTransform(
            f"{name}: its post-load step changes {differs + state} and cannot be re-run "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    again = _tensors(module)
    if again.keys() != after.keys() or not all(same_bits(again[k], after[k]) for k in after):
        raise UnsupportedTransform(
            f"{name}: its post-load step changes {differs + state}, is not a permutation, "
            "and re-running it from the checkpoint layout does not reproduce its result"
        )
    if inverse and all(v is not None for v in inverse.values()):
        transform = Transform("permutation", changed, inverse=inverse)  # type: ignore[arg-type]
    else:
        kinds, canonical = dict.fromkeys(made, "rederive"), {}
        for n in changed:
            live, canon = module._parameters.get(n), tensors[f"param:{n}"]
            if live is None or live.numel() == 0:
                # The original Parameter keeps its class and weight_loader; give it back its bytes.
                params[n].data = canon
                module._parameters[n] = params[n]
                kinds[f"param:{n}"] = "emptied"
                continue
            # Offsets the probe learns on `live` must address `canon`: the same layout, or rows appended.
            same_offsets = canon.stride() == live.stride() and not live.storage_offset()
            if not same_offsets or not all(c <= m for c, m in zip(canon.shape, live.shape)):
                raise UnsupportedTransform(
                    f"{name}: its post-load step re-lays {n} from {tuple(canon.shape)} {canon.stride()} to "
                    f"{tuple(live.shape)} {live.stride()}: offsets learned on the live tensor would not "
                    "address the checkpoint-layout copy that deltas are written into"
                )
            canonical[n] = canon
            kinds[f"param:{n}"] = "rederive"
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        own_layer = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, Fp8LinearMethod)  # on a stand-in
        sources = {f"{name}.{n}" if name else n for n, _ in module.named_parameters()}
        on_stand_in = type(module.quant_method) in own_layer
        unit = Unit(name, module, run_step, sources, kinds, canonical, "rerun", on_stand_in)
        units.append(unit)
        transform = Transform("rerun", changed, [k.split(":", 1)[1] for k in made], unit=weakref.ref(unit))
    setattr(module, TRANSFORM_ATTR, transform)
    return transform


def rerun_unit(module: nn.Module) -> Unit | None:
    """A "rerun" module's unit (its canonical tensors, its step)."""
    t = getattr(module, TRANSFORM_ATTR, None)
    return None if t is None or t.unit is None else t.unit()


@contextlib.contextmanager
def observing(model: nn.Module) -> Iterator[None]:
    """Observe each post-load step while vLLM's own loop runs it: quant methods' classified here, attention
    layers' and the model's by `derived.Discoverer`; their units land on the model in the order vLLM runs
    them."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    names = {id(m): n for n, m in model.named_modules()}
    found = derived.Discovery()
    setattr(model, derived.DISCOVERY_ATTR, found)
    shadowed: list[tuple[object, Callable[..., None]]] = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        real = getattr(method, "process_weights_after_loading", None)
        if real is not None and "process_weights_after_loading" not in vars(method):  # not observed yet
            shadowed.append((method, lambda m, real=real: classify(names[id(m)], m, real, found.units)))
    discoverer = derived.Discoverer(model, found)
    units = [(n, m) for n, m in model.named_modules() if is_deferred_attention_layer(m)]
    for name, module in units + ([("", model)] if hasattr(model, "process_weights_after_loading") else []):
        real = type(module).process_weights_after_loading

        def observed(*args, name=name, module=module, real=real, **kwargs) -> None:
            discoverer.observe(name, module, lambda m: real(m, *args, **kwargs))

        shadowed.append((module, observed))
    for owner, observed in shadowed:
        owner.process_weights_after_loading = observed
    try:
        yield
    finally:
        for owner, _ in shadowed:
            vars(owner).pop("process_weights_after_loading", None)


def install() -> None:
    """Wrap vLLM's post-load processing so every module's step is observed (flag on, any platform)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "_delta_wrapped", False):
        return

    @functools.wraps(original)
    def process_observed(model: nn.Module, model_config, target_device) -> None:
        with observing(model):
            original(model, model_config, target_device)

    process_observed._delta_wrapped = True  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process_observed
    install_reload_hooks()


def install_reload_hooks() -> None:
    """Make vLLM's layerwise in-place reload load "rerun" modules into their canonical tensors and re-run
    the step from there, exactly as after a delta."""
    from vllm.model_executor.model_loader.reload import layerwise

    if getattr(layerwise._layerwise_process, "_delta_wrapped", False):
        return
    process, copy_back = layerwise._layerwise_process, layerwise._copy_and_restore_kernel_tensors

    @functools.wraps(process)
    def process_from_canonical(layer: nn.Module, info) -> None:
        unit = rerun_unit(layer)
        if info.kernel_tensors is None or unit is None:
            return process(layer, info)
        method = layer.quant_method  # vLLM's own step on the reloaded copy is skipped
        method.process_weights_after_loading = lambda layer: None
        try:
            process(layer, info)
        finally:
            del method.process_weights_after_loading
        unit.rederive()

    @functools.wraps(copy_back)
    def copy_into_canonical(layer: nn.Module, info) -> None:
        unit = rerun_unit(layer)
        if unit is not None:
            params, _ = info.kernel_tensors
            for n, canon in unit.canonical.items():
                canon.copy_(getattr(layer, n))
                layer._parameters[n] = params[n]  # the live (processed) tensor is rebuilt by the re-run
        copy_back(layer, info)

    process_from_canonical._delta_wrapped = True  # type: ignore[attr-defined]
    layerwise._layerwise_process = process_from_canonical
    layerwise._copy_and_restore_kernel_tensors = copy_into_canonical


def canonical_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{param name: (live tensor, checkpoint-layout tensor that deltas are written into)}."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module in model.named_modules():
        unit = rerun_unit(module)
        stash = unit.canonical if unit is not None else {}
        for n, live in module.named_parameters(recurse=False):
            out.setdefault(f"{name}.{n}" if name else n, (live, stash.get(n, live)))
    return out


def offset_maps(model: nn.Module) -> dict[str, OffsetMap]:
    """{param name: its inverse map, at the parameter's storage offset} for every permuted parameter."""
    out = {}
    for name, module in model.named_modules():
        t: Transform | None = getattr(module, TRANSFORM_ATTR, None)
        if t is not None and t.kind == "permutation":
            for n, inverse in t.inverse.items():
                out[f"{name}.{n}" if name else n] = dataclasses.replace(
                    inverse, start=module._parameters[n].storage_offset()
                )
    return out


def transformed(model: nn.Module) -> dict[str, str]:
    """{module: "permutation" | "rerun" | "rederive" (attention layers' and the model's units)}."""
    out = {
        name: t.kind
        for name, m in model.named_modules()
        if (t := getattr(m, TRANSFORM_ATTR, None)) is not None and (t.changed or t.derived)
    }
    out.update({u.name: u.kind for u in derived.discovery(model).units if u.kind == "rederive"})
    return out
