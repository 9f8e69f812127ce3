"""Checkpoint tensors whose loader the probe cannot map (it scales, or writes non-affinely), served exactly.

Why not vLLM's `load_checkpoint_weight_patches`: it stages a full-shape NaN-masked tensor and runs
the loader on the live weights at commit, so its checks (and its loader-contract failures) come
after other tensors were already written; a loader that writes other than by one final `copy_`
lets NaN into live weights; and no digest checks its result.

Instead each such tensor keeps a shadow: its checkpoint-layout values on this rank's host, read
from the checkpoint at startup. Its loader is replayed under the probe's recording mode, which
performs no write: the recorded writes say exactly what a full load of a tensor would store
where. At startup the replay of the shadow must reproduce the live weights bit for bit, twice,
with no in-place arithmetic on a parameter and no overlapping writes; a loader that fails this is
refused (`refused`). In prepare the replay of the old and the new shadow gives the live
(offset, value) writes, checked against the live weights first, so the commit is a plain scatter
like any other tensor's, and the shadow is digested like the checkpoint it stands for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
SHADOW_SUFFIX = "#checkpoint"  # the shadow's target name: `{name}#checkpoint`


class UnservableLoader(Exception):
    """The loader of a tensor cannot be replayed exactly; the engine refuses delta updates."""


@dataclass
class Write:
    """What a load of one tensor stores in one live target: storage offsets and values (target dtype)."""

    target: str
    offsets: torch.Tensor
    values: torch.Tensor


def shadow_target(name: str) -> str:
    return name + SHADOW_SUFFIX


@dataclass
class _Recorded:
    target: str
    dst: torch.Tensor
    src: torch.Tensor


class _Recorder(TorchFunctionMode):
    """Record (and skip) `copy_` and `__setitem__` into parameter storage; list other in-place writes there."""

    def __init__(self, storages: Mapping[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.writes: list[_Recorded] = []
        self.foreign: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        target = (self.storages.get(first.untyped_storage().data_ptr())
                  if isinstance(first, torch.Tensor) and first.numel() else None)
        if target is None:
            return func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            self.writes.append(_Recorded(target, first, torch.as_tensor(args[1]).detach()))
            return first
        if func is torch.Tensor.__setitem__:
            self.writes.append(_Recorded(target, first[args[1]], torch.as_tensor(args[2]).detach()))
            return None
        name = getattr(func, "__name__", str(func))
        if (name.endswith("_") and not name.startswith("__")) or "out" in kwargs:
            self.foreign.append(f"{name} on {target}")  # recorded, never performed
            return first
        return func(*args, **kwargs)


def replay(load_weights: LoadWeights, storages: Mapping[int, str], name: str, tensor: torch.Tensor,
           live: Mapping[str, torch.Tensor]) -> list[Write]:
    """The writes `load_weights([(name, tensor)])` would make into `live` targets; performs none."""
    mode = _Recorder(storages)
    with torch.no_grad(), mode:
        load_weights([(name, tensor)])
    if mode.foreign:
        raise UnservableLoader("loader changes parameters in place: " + ", ".join(mode.foreign[:3]))
    writes = []
    for w in mode.writes:
        dst, target = w.dst, live[w.target]
        if dst.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
            raise UnservableLoader(f"loader writes {w.target} through a copy (advanced indexing)")
        offsets = torch.full((), dst.storage_offset(), dtype=torch.int64, device=target.device)
        for d, (n, stride) in enumerate(zip(dst.shape, dst.stride())):
            shape = [1] * dst.dim()
            shape[d] = n
            offsets = offsets + (torch.arange(n, device=target.device) * stride).reshape(shape)
        values = w.src.to(target.device).broadcast_to(dst.shape).to(dst.dtype)  # what copy_ would store
        writes.append(Write(w.target, offsets.reshape(-1), values.reshape(-1)))
    return writes


def _flat(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so equality is bit equality (NaN == NaN, -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differs(live: Mapping[str, torch.Tensor], writes: list[Write]) -> str | None:
    """The first target whose live values differ from `writes` (bitwise), or None."""
    for w in writes:
        if not torch.equal(bits(_flat(live[w.target])[w.offsets]), bits(w.values)):
            return w.target
    return None


def check_servable(load_weights: LoadWeights, storages: Mapping[int, str], name: str, shadow: torch.Tensor,
                   live: Mapping[str, torch.Tensor]) -> set[str]:
    """Refuse (`UnservableLoader`) a loader whose replay does not reproduce the loaded weights exactly;
    returns the targets the replay writes."""
    first = replay(load_weights, storages, name, shadow, live)
    again = replay(load_weights, storages, name, shadow, live)
    if not same_layout(first, again) or any(not torch.equal(bits(a.values), bits(b.values))
                                            for a, b in zip(first, again)):
        raise UnservableLoader("loader is not deterministic")
    for target in {w.target for w in first}:
        offsets = torch.cat([w.offsets for w in first if w.target == target])
        if offsets.unique().numel() != offsets.numel():
            raise UnservableLoader(f"loader writes some elements of {target} more than once")
    if (target := differs(live, first)) is not None:
        raise UnservableLoader(f"replaying the loader on the checkpoint does not give the loaded {target} "
                               "(a post-load step changed it, or the loader reads other state)")
    return {w.target for w in first}


def same_layout(a: list[Write], b: list[Write]) -> bool:
    return len(a) == len(b) and all(x.target == y.target and torch.equal(x.offsets, y.offsets) for x, y in zip(a, b))
