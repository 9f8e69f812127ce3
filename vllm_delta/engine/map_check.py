"""The placement map checked at startup against vLLM's own loader (a map wrong everywhere alike passes
every later check): per structural class of destination, the loader's writes of random values into one
scratch copy against the map's into another. One loader pass per layer (0.24 s at GLM-4.7's count)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from vllm_delta.engine.fallback import bits
from vllm_delta.engine.intercept import Intercept, LoadWeights, storage_key, storages_of
from vllm_delta.engine.placement import TensorPlacement
from vllm_delta.engine.staging import flat_storage

Checkpoint = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _random(numel: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded random bits of `dtype` (bit patterns: NaNs compare as bytes)."""
    size = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen, device=device).view(dtype)


def _layer(target: str) -> str:
    """`model.layers.5.` for a destination under layer 5; "" for one outside any numbered layer."""
    match = re.match(r"(.*?\.\d+\.)", target)
    return match.group(1) if match else ""


def check_map(
    load_weights: LoadWeights,
    params: Mapping[str, torch.Tensor],
    placements: Mapping[str, TensorPlacement],
    checkpoint: Checkpoint,
) -> dict[str, str]:
    """{destination: why} for each class whose map disagrees with the loader (`params` are never written)."""
    mapped = {n: p for n, p in placements.items() if not p.fallback_reason}
    chosen: dict[tuple, str] = {}
    for target in sorted({s.target for p in mapped.values() for s in p.segments} & params.keys()):
        chosen.setdefault((re.sub(r"\.\d+(?=\.|$)", ".#", target), tuple(params[target].shape)), target)
    by_layer: dict[str, list[str]] = {}
    for target in chosen.values():
        by_layer.setdefault(_layer(target), []).append(target)
    storages, errors = storages_of(params.items()), {}

    def values(i: int, name: str, device: torch.device) -> torch.Tensor:
        """Tensor `i`'s seeded random values, made again for each pass (one tensor in memory at a time)."""
        shape, dtype = checkpoint[name]
        return _random(math.prod(shape), dtype, i + 1, device).reshape(shape)

    for prefix, targets in by_layer.items():
        # Every tensor of the layer goes through the loader once, so one the map forgot is seen too.
        names = [n for n in mapped if _layer(n) == prefix]
        device = params[targets[0]].device  # made there: at 355B a layer's values are gigabytes
        by_loader = {
            t: _random(flat_storage(params[t]).numel(), params[t].dtype, i, device)
            for i, t in enumerate(targets)
        }
        by_map = {t: v.clone() for t, v in by_loader.items()}
        try:
            Intercept(
                storages, redirect={storage_key(params[t]): by_loader[t] for t in targets}, record=False
            ).run(load_weights, ((name, values(i, name, device)) for i, name in enumerate(names)))
        except Exception as exc:
            why = f"vLLM's loader failed on random values: {type(exc).__name__}: {exc}"
            errors.update({t: f"{t}: {why}" for t in targets})
            continue
        for i, name in enumerate(names):
            segments = [seg for seg in mapped[name].segments if seg.target in by_map]
            flat_src = values(i, name, device).reshape(-1) if segments else None
            for seg in segments:
                try:
                    torch.as_strided(by_map[seg.target], seg.sizes, seg.dst_strides, seg.dst_offset).copy_(
                        torch.as_strided(flat_src, seg.sizes, seg.src_strides, seg.src_offset)
                    )
                except RuntimeError as exc:  # the map reaches outside the checkpoint tensor or the storage
                    errors.setdefault(
                        seg.target, f"{seg.target}: the placement map of {name} is out of bounds: {exc}"
                    )
            # The probe's constant fills: a loader whose fill follows the values differs on random ones.
            for fill in (f for f in mapped[name].fills if f.target in by_map):
                view = torch.as_strided(by_map[fill.target], fill.sizes, fill.dst_strides, fill.dst_offset)
                view.fill_(fill.value)
        for target in targets:
            bad = bits(by_loader[target]) != bits(by_map[target])
            if target not in errors and bool(bad.any()):
                errors[target] = (
                    f"{target}: the placement map disagrees with vLLM's loader at {int(bad.sum())} of "
                    f"{bad.numel()} storage elements (first at offset {int(torch.nonzero(bad)[0])}), loading "
                    f"{len(names)} tensors"
                )
    return errors
