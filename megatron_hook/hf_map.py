"""Where each element of a rank's Megatron weights sits in the HF checkpoint, from mbridge's own code:
hand-written tables drift from the converter that exported it. Id tensors (`BlockIds`) go through
`_weight_merge_across_tp` and `_weight_to_hf_format` (pinned `mbridge==0.15.1`); where this rank's ids
land places its elements. One replica ships each element (TP rank 0 of a replicated param, DP rank 0)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_hook.block_ids import BlockIds
from megatron_hook.families import TENamed, refuse_unsupported, tied_copy, with_model_vocab
from vllm_delta.sender.shards import Segments, strided, strided_view

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

        return cls(
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_expert_data_parallel_rank(),
        )


def local_tensors(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine serves from this chunk: its parameters and the MoE `expert_bias` buffers."""
    out = dict(gpt.named_parameters())
    buffers = gpt.state_dict(keep_vars=True).items()
    return out | {n: t for n, t in buffers if n.endswith("expert_bias") and n not in out}


def chunk_segments(bridge, gpt: torch.nn.Module, par: Parallel | None = None) -> list[Segments]:
    """This rank's shippable elements of one model chunk, as `Segments` over views of its live tensors."""
    par = par or Parallel.current()
    refuse_unsupported(list(local_tensors(gpt)), par.tp_size, par.etp_size)  # families.py
    bridge = with_model_vocab(bridge, gpt, par.tp_size)
    return [s for args in shipped(bridge, gpt, par) for s in probe(bridge, *args)]


def shipped(
    bridge, gpt: torch.nn.Module, par: Parallel | None = None
) -> Iterator[tuple[str, torch.Tensor, int, int]]:
    """`(global TE name, tensor, TP rank, TP size)` of each tensor this rank ships (size 1: not split)."""
    par = par or Parallel.current()
    view = TENamed(gpt)
    to_global = bridge._weight_name_mapping_mcore_local_to_global(view)  # TE local -> TE global name
    for name, t in local_tensors(gpt).items():
        if tied_copy(gpt, name):
            continue  # another stage ships these elements (families.py)
        te = view.te[name]
        expert = _EXPERT_KEY in te
        if (par.edp_rank if expert else par.dp_rank) != 0:
            continue
        size, rank = (par.etp_size, par.etp_rank) if expert else (par.tp_size, par.tp_rank)
        split = size > 1 and (expert or getattr(t, "tensor_model_parallel", False))
        if not split and (par.etp_rank if expert else par.tp_rank) != 0:
            continue  # replicated across TP: TP rank 0 ships it
        yield to_global[te], t, rank if split else 0, size if split else 1


def probe(bridge, global_name: str, t: torch.Tensor, rank: int, size: int) -> list[Segments]:
    """Block ids (a block per row) through mbridge's TP merge and HF conversion; a `Segments` per HF name."""
    n = t.numel()
    width = t.shape[-1] if t.dim() > 1 else 1
    ids = [BlockIds.arange(k * n, t.shape, width) for k in range(size)]
    try:
        merged = bridge._weight_merge_across_tp(global_name, ids, t) if size > 1 else ids[0]
        names, hf = bridge._weight_to_hf_format(global_name, merged)
    except (NotImplementedError, AttributeError, TypeError) as e:
        raise NotImplementedError(
            f"{global_name}: mbridge's conversion does something the block probe does not "
            f"model ({e}); refusing rather than guessing its HF positions"
        ) from e
    flat = t.detach().reshape(-1)
    out = []
    for hf_name, hf_ids in zip(names, hf):
        starts, w = hf_ids.starts.reshape(-1), hf_ids.width
        blocks = torch.nonzero((starts >= rank * n) & (starts < (rank + 1) * n)).reshape(-1)
        if not blocks.numel():
            continue
        local = starts[blocks] - rank * n
        order = torch.argsort(local)
        local, hf_pos = local[order], blocks[order] * w
        view = _view(flat, runs_of(local, w), global_name)
        out.append(Segments(hf_name, view, tuple(hf_ids.shape), runs_of(hf_pos, w)))
    return out


def runs_of(starts: torch.Tensor, width: int = 1) -> tuple[tuple[int, int], ...]:
    """Blocks of `width` at `starts` (in order) merged into `(start, length)` runs of consecutive elements."""
    breaks = torch.nonzero(starts[1:] - starts[:-1] != width).reshape(-1) + 1
    first = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.diff(torch.cat([first, torch.tensor([starts.numel()])])) * width
    return tuple(zip(starts[first].tolist(), lengths.tolist()))


def _view(flat: torch.Tensor, runs: tuple[tuple[int, int], ...], name: str) -> torch.Tensor:
    """A view of `flat` over the sorted local runs; a copy would not follow the live weights: refused."""
    if not strided(runs):
        raise NotImplementedError(
            f"{name}: local elements of one HF tensor are not a strided view: {runs[:4]}"
        )
    return strided_view(flat, runs)
