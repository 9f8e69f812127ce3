"""The original element-wise registration probe, kept as the test reference for `megatron_hook.hf_map.probe`.

Why test-only: it builds TP full-size int64 id tensors plus a merged copy and argsorts them, O(elements)
in time and host memory (5-25 minutes and 15-20 GB per rank at 355B, issue 18 "Why 1"). It is the most
direct reading of mbridge's conversion - every element's id goes through `_weight_merge_across_tp` and
`_weight_to_hf_format` - so the product's block probe is checked against it on sizes tests can afford.
"""

from __future__ import annotations

import torch

from megatron_hook.hf_map import runs_of
from vllm_delta.sender.shards import Segments


def full_probe(bridge, global_name: str, t: torch.Tensor, rank: int, size: int) -> list[Segments]:
    """Run one id per element through mbridge's TP merge and HF conversion; one `Segments` per HF tensor."""
    n = t.numel()
    ids = [torch.arange(k * n, (k + 1) * n, dtype=torch.int64).view(t.shape) for k in range(size)]
    merged = bridge._weight_merge_across_tp(global_name, ids, t) if size > 1 else ids[0]
    names, hf = bridge._weight_to_hf_format(global_name, merged)
    flat = t.detach().reshape(-1)
    out = []
    for hf_name, hf_ids in zip(names, hf):
        hf_flat = hf_ids.reshape(-1)
        mine = (hf_flat >= rank * n) & (hf_flat < (rank + 1) * n)
        positions = torch.nonzero(mine).reshape(-1)
        local = hf_flat[positions] - rank * n
        order = torch.argsort(local)
        local, positions = local[order], positions[order]
        if local.numel():
            out.append(
                Segments(hf_name, _view(flat, local, global_name), tuple(hf_ids.shape), runs_of(positions))
            )
    return out


def _view(flat: torch.Tensor, local: torch.Tensor, name: str) -> torch.Tensor:
    runs = runs_of(local)
    if len(runs) == 1:
        a, length = runs[0]
        return flat[a : a + length]
    lengths = {length for _, length in runs}
    strides = {b - a for (a, _), (b, _) in zip(runs, runs[1:])}
    if len(lengths) != 1 or len(strides) != 1:
        raise NotImplementedError(
            f"{name}: local elements of one HF tensor are not a strided view: {runs[:4]}"
        )
    (length,), (stride,) = lengths, strides
    return flat.as_strided((len(runs), length), (stride, 1), flat.storage_offset() + runs[0][0])


def chunk_segments_full(bridge, gpt: torch.nn.Module, par) -> list[Segments]:
    """`hf_map.chunk_segments` with the element-wise probe (the same replica rules: `hf_map.shipped`)."""
    from megatron_hook.hf_map import shipped

    return [s for args in shipped(bridge, gpt, par) for s in full_probe(bridge, *args)]
