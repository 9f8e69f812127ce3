"""Post-load transforms: modules whose post-load step re-lays or derives weights.

Why: the probe sees `load_weights`, not the step after it; a step that swaps a fused w13's halves or
derives `W_UV` would make an in-place delta land in the wrong slot or leave a stale copy. So each
step is observed as vLLM runs it (`install`) and classified: unchanged; `permutation` (parameters
only, their contents permuted, proven with element ids: deltas go through the inverse `OffsetMap`);
`rerun` (re-running the step from the checkpoint layout reproduces it bit for bit: deltas go to a
canonical copy, `canonical_weights`); else `UnsupportedTransform`, and the engine refuses to start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine import canonical_weights, derived
from vllm_delta.engine.stand_in import held_tensors, same_bits

TRANSFORM_ATTR = "_delta_transform"  # the module's `Transform`


class UnsupportedTransform(RuntimeError):
    """A post-load step that is neither a permutation nor reproducible from the checkpoint layout."""


@dataclass
class Transform:
    """What a module's post-load step did, and how deltas reach its weights."""

    module: str
    kind: str  # "permutation" | "rerun"
    changed: list[str] = field(default_factory=list)  # parameters whose bits changed
    derived: list[str] = field(default_factory=list)  # other tensors the step added or changed
    state: list[str] = field(default_factory=list)  # non-tensor attributes the step set (opaque)
    # permutation: param name -> inverse map (loaded position -> position after the step), start 0
    inverse: dict[str, OffsetMap] = field(default_factory=dict)


@dataclass(frozen=True)
class OffsetMap:
    """Where a permuting step moved a parameter's elements: loaded storage offset -> live one.

    Why rows: a step moving whole rows (w13 half swap, row reorder) keeps one entry a row; an int32
    an element would be twice a bf16 weight. Other permutations keep one an element (`row_len` 1).
    """

    start: int  # the parameter's storage offset
    table: torch.Tensor  # loaded row -> live row (int32 below 2**31 rows)
    row_len: int = 1

    @property
    def numel(self) -> int:
        return self.table.numel() * self.row_len

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

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


@dataclass
class Snapshot:
    """A module before its step: tensor clones, the Parameter objects, identities of other attributes."""

    tensors: dict[str, torch.Tensor]
    params: dict[str, nn.Parameter]
    state: dict[str, int]


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the module holds itself (`stand_in.held_tensors`), parameters detached."""
    return {k: t.detach() if kind == "param" else t for k, (kind, _, t) in held_tensors(module).items()}


def _state(module: nn.Module) -> dict[str, int]:
    """Public non-tensor attributes by identity: a step that sets one may hide a weight copy in it."""
    return {
        n: id(v) for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, torch.Tensor)
    }


def snapshot(module: nn.Module) -> Snapshot:
    return Snapshot(
        {k: t.detach().clone() for k, t in _tensors(module).items()},
        dict(module.named_parameters(recurse=False)),
        _state(module),
    )


def _rerun(module: nn.Module, before: Snapshot, changed: list[str]) -> None:
    """The step again, from the checkpoint-layout values of `changed` in their original Parameters."""
    for n in changed:
        param = before.params[n]
        param.data = before.tensors[f"param:{n}"].clone()
        module._parameters[n] = param
    canonical_weights.post_load_step(module)()


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
        canonical_weights.post_load_step(module)()
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


def _prefix_layout(canon: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether every element of the checkpoint-layout `canon` sits at the same storage offset in `live`
    (offsets the probe learns on `live` address `canon`): the same layout, or rows appended."""
    return (
        canon.dim() == live.dim()
        and canon.stride() == live.stride()
        and live.storage_offset() == 0
        and all(c <= n for c, n in zip(canon.shape, live.shape))
    )


def classify(name: str, module: nn.Module, before: Snapshot) -> Transform | None:
    """Classify what the step did to `module` (it has just run) and prepare deltas for it."""
    after = {k: t.clone() for k, t in _tensors(module).items()}
    differs = sorted(
        k for k in before.tensors.keys() | after.keys() if not same_bits(before.tensors.get(k), after.get(k))
    )
    now = _state(module)
    state = sorted(n for n in now if before.state.get(n) != now[n])
    if not differs and not state:
        return None
    changed = [k.split(":", 1)[1] for k in differs if k.startswith("param:") and k in before.tensors]
    derived = [k.split(":", 1)[1] for k in differs if k not in before.tensors or not k.startswith("param:")]
    # A step may consume parameters (fp8 KV-cache scales folded into `_k_scale`): never a permutation.
    consumed = [n for n in changed if f"param:{n}" not in after]
    inverse: dict[str, OffsetMap | None] = {}
    try:
        for n in changed if not derived and not state and not consumed else []:
            inverse[n] = _inverse_permutation(module, n, before.tensors[f"param:{n}"], after[f"param:{n}"])
            _rerun(module, before, changed)  # back from the id probe
            if inverse[n] is None:
                break
        if not inverse:
            _rerun(module, before, changed)
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
        transform = Transform(name, "permutation", changed, [], [], inverse)  # type: ignore[arg-type]
    else:
        for n in changed:
            live, canon = module._parameters.get(n), before.tensors[f"param:{n}"]
            if live is not None and live.numel() and not _prefix_layout(canon, live):
                raise UnsupportedTransform(
                    f"{name}: its post-load step re-lays {n} from {tuple(canon.shape)} {canon.stride()} to "
                    f"{tuple(live.shape)} {live.stride()}: offsets learned on the live tensor would not "
                    "address the checkpoint-layout copy that deltas are written into"
                )
        transform = Transform(name, "rerun", changed, derived, state)
        canonical_weights.keep_canonical(
            module, {n: before.tensors[f"param:{n}"] for n in changed}, before.params
        )
    setattr(module, TRANSFORM_ATTR, transform)
    return transform


@contextlib.contextmanager
def observing(model: nn.Module) -> Iterator[None]:
    """Observe each post-load step while vLLM's own loop runs it: quant methods' steps classified here,
    attention layers' and the model's own discovered by `derived`."""
    names = {id(m): n for n, m in model.named_modules()}
    shadowed = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        real = getattr(method, "process_weights_after_loading", None)
        if real is None or "process_weights_after_loading" in vars(method):
            continue  # no step, or a method shared by several modules and already observed

        def observed(layer: nn.Module, method=method, real=real) -> None:
            before = snapshot(layer)
            real(layer)
            shadow = vars(method).pop("process_weights_after_loading")  # re-runs use the real step
            try:
                classify(names[id(layer)], layer, before)
            finally:
                method.process_weights_after_loading = shadow

        shadowed.append((method, observed))
    shadowed += derived.observe_units(model)
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
    canonical_weights.install_reload_hooks()


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
    """{module: "permutation" | "rerun" | "rederive" (`derived`'s units)} for the status."""
    out = {
        name: t.kind
        for name, m in model.named_modules()
        if (t := getattr(m, TRANSFORM_ATTR, None)) is not None and (t.changed or t.derived)
    }
    out.update({u.name: "rederive" for u in derived.discovery(model).units})
    return out
