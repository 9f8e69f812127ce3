"""The snapshot's values from the engines' own HF checkpoint: `DeltaSender.seed_from_checkpoint`'s reading.

Why its own module: seeding from the served bytes is exact even where the trainer's round trip is not,
and a block-fp8 checkpoint changes what is seeded (its codes and `weight_scale_inv`, the quantizer the
captures then need, or a refusal naming the tensor), which is one job beside the sender's sync loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from vllm_delta.sender.fp8_quant import BlockFp8Quantizer
from vllm_delta.sender.segments import Segments
from vllm_delta.sender.shards import Shard


def checkpoint_seed(
    hf_dir: str | Path, names: Iterable[str] | None, like: list[Shard | Segments] | None
) -> tuple[Iterable, BlockFp8Quantizer | None]:
    """(what to seed, the block-fp8 quantizer or None). Without `like`: whole tensors (all, or the named
    ones and their block scales); with `like` (the shards this rank will capture): each one's elements
    of the checkpoint tensor on that shard's device, reading only this rank's slices."""
    from vllm_delta.wire.checkpoint import Checkpoint

    ckpt = Checkpoint.open(hf_dir)
    if like is None:
        if names is None:
            return ckpt.iter_tensors(), BlockFp8Quantizer.served(ckpt)
        wanted = list(dict.fromkeys(names))  # only the named tensors' shards are opened
        fp8 = BlockFp8Quantizer.served(ckpt, [n for n in wanted if n in ckpt])
        return ((n, ckpt.read(n)) for n in (fp8.with_scales(wanted) if fp8 else wanted) if n in ckpt), fp8
    if missing := sorted({s.name for s in like if s.name not in ckpt}):
        raise KeyError(f"not in the checkpoint: {missing[:5]}")
    fp8 = BlockFp8Quantizer.served(ckpt, [s.name for s in like])
    scales = fp8.scale_parts(like) if fp8 else []  # this rank's blocks' scales

    def part(s: Shard | Segments) -> torch.Tensor:  # segments by their runs: no per-element index
        got = (
            ckpt.read_runs(s.name, s.runs)
            if isinstance(s, Segments)
            else ckpt.read_at(s.name, s.global_index().cpu())
        )
        return got.reshape(s.tensor.shape).to(s.tensor.device)

    return [s.with_tensor(part(s)) for s in like + scales], fp8
