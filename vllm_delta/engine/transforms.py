"""Post-load transforms: modules whose `process_weights_after_loading` re-lays or derives weights.

Why: the placement probe sees `load_weights`, not the post-load step that runs after it. A step
that swaps the halves of a fused w13 (FlashInfer-CUTLASS MoE) or derives `W_UV` from
`kv_b_proj` (MLA) makes an in-place delta land in the wrong slot, or leaves the derived tensor
stale: silently wrong weights. So, with delta updates on, each module's post-load step is run
under observation (`run_post_load`) and classified:

- unchanged: nothing to do;
- `permutation`: every changed parameter keeps its shape and dtype and its new contents are a
  permutation of the old (proven by re-running the step on a copy of the module holding element
  ids, then checked on the real bits): deltas are written through the inverse map;
- `rerun`: anything else (a derived tensor, a repack): the step re-run from the checkpoint-layout
  tensors reproduces the first result bit for bit, so deltas go to a canonical copy (the same
  stash `cpu_weights` keeps) and the step is re-run on touched modules after each commit;
- neither: `UnsupportedTransform`, naming the module, so the engine refuses to start.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine.cpu_weights import RESTORED_ATTR, STASH_ATTR

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
    # permutation: param name -> inverse map (loaded position -> position after the step)
    inverse: dict[str, torch.Tensor] = field(default_factory=dict)


def post_load_step(module: nn.Module) -> Callable[[], None] | None:
    """The module's post-load step as vLLM runs it for quantized (incl. unquantized) layers."""
    method = getattr(module, "quant_method", None)
    step = getattr(method, "process_weights_after_loading", None)
    return None if step is None else (lambda: step(module))


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the module holds itself: parameters, buffers and plain tensor attributes."""
    out = {f"param:{n}": p.detach() for n, p in module.named_parameters(recurse=False)}
    out.update({f"buffer:{n}": b for n, b in module.named_buffers(recurse=False)})
    out.update({f"attr:{n}": v for n, v in vars(module).items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _clone_all(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in tensors.items()}


def _inverse_permutation(module: nn.Module, step_of: Callable[[nn.Module], Callable[[], None] | None],
                         name: str, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None:
    """Inverse map of a step that permutes parameter `name`, or None if it does not.

    The step runs on a copy of the module whose `name` holds its element ids (float64, exact to
    2**53): a pure permutation moves the ids and nothing else.
    """
    if before.shape != after.shape or before.dtype != after.dtype or not after.is_contiguous():
        return None
    n = before.numel()
    probe = copy.deepcopy(module)
    probe._parameters[name].data = torch.arange(n, dtype=torch.float64, device=before.device).view(before.shape)
    try:
        step_of(probe)()
    except Exception:
        return None
    ids = probe._parameters.get(name)
    if ids is None or ids.dtype != torch.float64 or ids.shape != before.shape:
        return None
    perm = ids.detach().reshape(-1)
    if not torch.equal(perm.sort().values, torch.arange(n, dtype=torch.float64, device=perm.device)):
        return None
    perm = perm.to(torch.int64)
    if not _same(after.reshape(-1), before.reshape(-1)[perm]):  # the real bits moved the same way
        return None
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n, dtype=torch.int64, device=perm.device)
    return inverse.to(torch.int32) if n < 1 << 31 else inverse


def _classify(name: str, module: nn.Module, step_of: Callable[[nn.Module], Callable[[], None] | None],
              before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> Transform | None:
    differs = sorted(k for k in before.keys() | after.keys() if not _same(before.get(k), after.get(k)))
    if not differs:
        return None
    changed = [k.split(":", 1)[1] for k in differs if k.startswith("param:") and k in before]
    derived = [k.split(":", 1)[1] for k in differs if k not in before or not k.startswith("param:")]
    if not derived:
        inverse = {n: _inverse_permutation(module, step_of, n, before[f"param:{n}"], after[f"param:{n}"])
                   for n in changed}
        if all(v is not None for v in inverse.values()):
            return Transform(name, "permutation", changed, [], inverse)
    # Re-run from the checkpoint layout on a copy: it must reproduce the first result exactly.
    probe = copy.deepcopy(module)
    for n in changed:
        probe._parameters[n].data = before[f"param:{n}"].clone()
    try:
        step_of(probe)()
    except Exception as exc:
        raise UnsupportedTransform(f"{name}: its post-load step changes {differs} and cannot be re-run "
                                   f"({type(exc).__name__}: {exc})") from exc
    again = _tensors(probe)
    if again.keys() != after.keys() or not all(_same(again[k], after[k]) for k in after):
        raise UnsupportedTransform(f"{name}: its post-load step changes {differs}, is not a permutation, and "
                                   "re-running it from the checkpoint layout does not reproduce its result")
    return Transform(name, "rerun", changed, derived)


def run_post_load(model: nn.Module,
                  step_of: Callable[[nn.Module], Callable[[], None] | None] = post_load_step) -> dict[str, Transform]:
    """Run every module's post-load step, classify what it did and prepare deltas for it.

    Rerun modules get the checkpoint-layout copy of each changed parameter in `cpu_weights`'
    stash (deltas are written there; `cpu_weights.refresh` re-runs the step). Raises
    `UnsupportedTransform` naming the first module that can be served neither way.
    """
    found: dict[str, Transform] = {}
    for name, module in model.named_modules():
        step = step_of(module)
        if step is None:
            continue
        before = _clone_all(_tensors(module))
        step()
        transform = _classify(name, module, step_of, before, _tensors(module))
        if transform is None:
            continue
        setattr(module, TRANSFORM_ATTR, transform)
        if transform.kind == "rerun":
            setattr(module, STASH_ATTR, {n: before[f"param:{n}"] for n in transform.changed})
            setattr(module, RESTORED_ATTR, set())
        found[name] = transform
    return found


def offset_maps(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """{param name: (its storage offset, inverse map)} for every permuted parameter."""
    out = {}
    for name, module in model.named_modules():
        t: Transform | None = getattr(module, TRANSFORM_ATTR, None)
        if t is not None and t.kind == "permutation":
            for n, inverse in t.inverse.items():
                out[f"{name}.{n}" if name else n] = (module._parameters[n].storage_offset(), inverse)
    return out


def transformed(model: nn.Module) -> dict[str, str]:
    """{module: "permutation" | "rerun"} for the status."""
    return {name: t.kind for name, m in model.named_modules() if (t := getattr(m, TRANSFORM_ATTR, None)) is not None}
