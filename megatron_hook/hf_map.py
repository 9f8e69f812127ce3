"""Where each element of a rank's Megatron weights sits in the HF checkpoint, from mbridge's own code.

Why: a trainer rank must diff its own shard and name the changed elements in HF coordinates
without gathering weights. Hand-written per-family layout tables drift from the converter that
exported the served checkpoint; instead each local tensor is probed through mbridge's conversion
itself. For a param split across R tensor-parallel ranks, R int64 id tensors (rank k's ids are
k * numel + arange) go through `_weight_merge_across_tp` and `_weight_to_hf_format`, exactly as
`export_weights` moves real values; the ids of this rank that come out in HF tensor `h` at flat
position j say that local element i is `h[j]`. Ids that vanish (padded vocab rows) have no HF
position and are never shipped. The map is compressed at once into `Segments` runs; the id
tensors are transient and about one tensor's worth at a time.

Exactly one replica ships each element: a rank holds a tensor only if it is this rank's part of
a partitioned param, or TP rank 0 of a replicated one, and only DP rank 0 (expert-DP rank 0 for
experts) ships at all. Each PP stage and EP rank probes only what it holds.

The private mbridge methods used are pinned with `mbridge==0.15.1` (pyproject.toml).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_hook.names import TENamed
from vllm_delta.sender.segments import Segments, runs_of

_EXPERT_KEY = ".mlp.experts.linear_fc"


@dataclass(frozen=True)
class Parallel:
    """This rank's coordinates (megatron parallel_state at registration)."""

    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    dp_rank: int  # with context parallel
    edp_rank: int  # expert data parallel

    @classmethod
    def current(cls) -> Parallel:
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                   ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank())


def local_tensors(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine serves from this chunk: its parameters, plus the MoE `expert_bias`
    buffers (updated outside the optimizer; mbridge exports them the same way)."""
    out = dict(gpt.named_parameters())
    for name, t in gpt.state_dict(keep_vars=True).items():
        if name.endswith("expert_bias") and name not in out:
            out[name] = t
    return out


def chunk_segments(bridge, gpt: torch.nn.Module, par: Parallel | None = None) -> list[Segments]:
    """This rank's shippable elements of one model chunk, as `Segments` over views of its live tensors."""
    par = par or Parallel.current()
    view = TENamed(gpt)
    to_global = bridge._weight_name_mapping_mcore_local_to_global(view)  # TE local -> TE global name
    out: list[Segments] = []
    for name, t in local_tensors(gpt).items():
        te = view.te[name]
        expert = _EXPERT_KEY in te
        if (par.edp_rank if expert else par.dp_rank) != 0:
            continue
        size, rank = (par.etp_size, par.etp_rank) if expert else (par.tp_size, par.tp_rank)
        split = size > 1 and (expert or getattr(t, "tensor_model_parallel", False))
        if not split and (par.etp_rank if expert else par.tp_rank) != 0:
            continue  # replicated across TP: TP rank 0 ships it
        out.extend(probe(bridge, to_global[te], t, rank if split else 0, size if split else 1))
    return out


def probe(bridge, global_name: str, t: torch.Tensor, rank: int, size: int) -> list[Segments]:
    """Run id tensors through mbridge's TP merge and HF conversion; one `Segments` per HF tensor."""
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
            out.append(Segments.from_positions(hf_name, _view(flat, local, global_name), tuple(hf_ids.shape),
                                               positions))
    return out


def _view(flat: torch.Tensor, local: torch.Tensor, name: str) -> torch.Tensor:
    """A view of `flat` at the sorted local positions `local`: one range, or equal runs at a
    constant stride (a rank's q, k or v rows across its query groups). Anything else would need
    a copy that does not follow the live weights, so it is refused."""
    runs = runs_of(local)
    if len(runs) == 1:
        a, length = runs[0]
        return flat[a:a + length]
    lengths = {length for _, length in runs}
    strides = {b - a for (a, _), (b, _) in zip(runs, runs[1:])}
    if len(lengths) != 1 or len(strides) != 1:
        raise NotImplementedError(f"{name}: local elements of one HF tensor are not a strided view: {runs[:4]}")
    (length,), (stride,) = lengths, strides
    return flat.as_strided((len(runs), length), (stride, 1), flat.storage_offset() + runs[0][0])
