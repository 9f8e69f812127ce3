"""Every element of every destination parameter is reached by the map: the check from the parameters' side.

Why: the coverage check looks from the checkpoint's side (each tensor's elements held once across
the ranks), and a tensor no rank's loader reads counts as "ignored" there, as vLLM ignores rotary
`inv_freq`. A probe that misses a loader's writes turns a real tensor into an ignored one, and every
delta to it is then dropped while the commit answers ok (found once: after vLLM's `reload_weights`
its recorded loaders load nothing, engine/loaders.py). Seen from the parameters, the same mistake is
a destination that fewer elements reach than it holds. Segment and fill sizes are summed per
destination (O(segments), no element is touched), and a destination a fallback replay writes counts
as reached; any other shortfall refuses updates at startup, naming the parameter. Only destinations
the model's `load_weights` says it loaded are held to it (vLLM's models return those names): a
parameter the checkpoint lacks keeps vLLM's default (fp8's `k_scale`) and no delta can name it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from vllm_delta.engine.placement import TensorPlacement


def unreached(
    placements: Mapping[str, TensorPlacement],
    destinations: Mapping[str, torch.Tensor],
    replayed: Iterable[str] = (),
) -> dict[str, str]:
    """{destination: why} for each destination (probe name -> the tensor deltas are written into) that
    the segments and fills reach fewer elements of than it holds; destinations in `replayed` (written
    by a fallback's loader replay) are not counted here."""
    reached: Counter[str] = Counter()
    for placement in placements.values():
        for seg in placement.segments:
            reached[seg.target] += seg.numel
        for fill in placement.fills:
            reached[fill.target] += math.prod(fill.sizes)
    skip = set(replayed)
    return {
        name: (
            f"the map reaches {reached[name]} of its {t.numel()} elements: some loader write was not "
            "seen at startup, so deltas to the tensors behind it would be dropped"
        )
        for name, t in destinations.items()
        if name not in skip and reached[name] < t.numel()
    }


def derived_params(keys: Iterable[tuple[str, str]]) -> set[str]:
    """Full names of the parameters among derived tensors ((unit, key) as `derived.DerivedTensor` holds
    them: "param:W_UV", "kv_b_proj.param:weight"): a post-load step made them, no checkpoint element
    reaches them, and `derived` keeps them exact instead."""
    out = set()
    for unit, key in keys:
        path, _, leaf = key.rpartition(".")
        kind, _, attr = leaf.partition(":")
        if kind == "param":
            out.add(".".join(p for p in (unit, path, attr) if p))
    return out
