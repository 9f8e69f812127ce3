"""The placement map checked at startup against vLLM's own loader, independently of the map.

Why: the probe learns the map from the views a loader copies; everything after it (locate, the
digests, the commit, a full verify) goes through that map, so a map that is wrong the same way
everywhere passes every later check. Here, per structural class of destination parameter (one
layer's fused `w13_weight`, one layer's `qkv_proj`, ...), the first destination of the class gets
two scratch copies of its storage, filled with the same seeded random bytes. Every checkpoint
tensor that lands in it is given seeded random values; vLLM's loader runs on them for real, its
writes into parameters redirected into the first copy; the map's segments scatter the same
values into the second. Any difference - a wrong offset, a missed or extra write, a transformed
value - is a wrong map, and the engine refuses updates naming the destination.

Cost: per class, the tensors of one layer through the loader (values made on the destination's
device, one tensor at a time), and two scratch copies of the class's destination there (at GLM-4.7
TP=8, the fused w13 of one layer: 2 x 630 MB, freed after its class). It runs in `delta_coverage`,
inside vLLM's `collective_rpc`, so it holds the engine loop for that long (not measured at full size).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from vllm_delta.engine.placement import TensorPlacement, _written, storage_key

Checkpoint = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def structural_class(target: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """Destinations that differ only in their layer (or other) index and share a shape."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", target), tuple(shape)


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Seeded random bits of `dtype` on the generator's device (bit patterns: NaNs compare as bytes)."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen, device=gen.device).view(dtype)


def _flat_like(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


class _Redirect(TorchDispatchMode):
    """Run the loader for real, its writes into the checked storage done on a scratch copy instead;
    writes into any other parameter's storage are not performed."""

    def __init__(self, params: set[int], target: int, scratch: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.params, self.target, self.scratch = params, target, scratch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        swap = {}
        written = _written(func, args, kwargs)
        for w in written:
            key = storage_key(w)
            if key == self.target:
                swap[id(w)] = self.scratch(w)
            elif key in self.params:  # another parameter (a name sharing a storage is the same one)
                return written[0] if len(func._schema.returns) <= 1 else tuple(written)
        if swap:
            args, kwargs = tree_map(lambda t: swap.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return func(*args, **kwargs)


def live_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live parameters by the names the probe's segments target (engine/cpu_weights.py)."""
    from vllm_delta.engine import cpu_weights

    return {name: live for name, (live, _) in cpu_weights.canonical_tensors(model).items()}


def check_map(load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
              params: Mapping[str, torch.Tensor], placements: Mapping[str, TensorPlacement],
              checkpoint: Checkpoint, seed: int = 0) -> dict[str, str]:
    """{destination: why} for each class whose map disagrees with the loader (empty: all agree).

    `params` are the live parameters by the names the segments target (never written here).
    """
    feeding = {s.target for p in placements.values() if not p.fallback_reason for s in p.segments}
    chosen: dict[tuple, str] = {}
    for target in sorted(feeding):
        if target in params:
            chosen.setdefault(structural_class(target, tuple(params[target].shape)), target)
    storages = {storage_key(t) for t in params.values() if t.numel() > 0}
    errors = {}
    for target in chosen.values():
        # Every tensor of the destination's layer goes through the loader, so one the map forgot is seen.
        prefix = _layer_prefix(target)
        names = [n for n, p in placements.items() if not p.fallback_reason and n.startswith(prefix)]
        if (why := _check_one(load_weights, storages, params, placements, checkpoint, target, names, seed)) is not None:
            errors[target] = why
    return errors


def _layer_prefix(target: str) -> str:
    """`model.layers.5.` for a destination under layer 5; "" for one outside any numbered layer."""
    match = re.match(r"(.*?\.\d+\.)", target)
    return match.group(1) if match else ""


def _check_one(load_weights, storages: set[int], params: Mapping[str, torch.Tensor],
               placements: Mapping[str, TensorPlacement], checkpoint: Checkpoint, target: str,
               names: list[str], seed: int) -> str | None:
    live = params[target]
    # Made on the destination's device: at 355B a layer's values are gigabytes, generated in milliseconds there.
    start = _random(_flat_like(live), live.dtype, torch.Generator(live.device).manual_seed(seed))
    by_loader, by_map = start, start.clone()

    def scratch(w: torch.Tensor) -> torch.Tensor:
        if w.dtype != by_loader.dtype:
            raise TypeError(f"loader writes {target} as {w.dtype}, the parameter is {by_loader.dtype}")
        return torch.as_strided(by_loader, w.shape, w.stride(), w.storage_offset())

    def values(i: int, name: str) -> torch.Tensor:
        """Tensor `i`'s seeded random values, made again for each pass (one tensor in memory at a time)."""
        shape, dtype = checkpoint[name]
        g = torch.Generator(live.device).manual_seed(seed * 1_000_003 + i + 1)
        return _random(torch.Size(shape).numel(), dtype, g).reshape(shape)

    try:
        with torch.no_grad(), _Redirect(storages, storage_key(live), scratch):
            load_weights((name, values(i, name)) for i, name in enumerate(names))
    except Exception as exc:
        return f"{target}: vLLM's loader failed on random values: {type(exc).__name__}: {exc}"
    for i, name in enumerate(names):
        segments = [seg for seg in placements[name].segments if seg.target == target]
        flat_src = values(i, name).reshape(-1) if segments else None
        for seg in segments:
            try:
                torch.as_strided(by_map, seg.sizes, seg.dst_strides, seg.dst_offset).copy_(
                    torch.as_strided(flat_src, seg.sizes, seg.src_strides, seg.src_offset))
            except RuntimeError as exc:  # the map reaches outside the checkpoint tensor or the storage
                return f"{target}: the placement map of {name} is out of bounds: {exc}"
    bad = torch.ne(by_loader.view(torch.uint8).view(-1, live.element_size()),
                   by_map.view(torch.uint8).view(-1, live.element_size())).any(1)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        return (f"{target}: the placement map disagrees with vLLM's loader at {int(bad.sum())} of "
                f"{bad.numel()} storage elements (first at offset {first}), loading {len(names)} tensors")
    return None

