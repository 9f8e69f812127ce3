"""Worker-side half of `benchmarks/peers.py`: vLLM's `sparse_nccl` apply path inside the vLLM worker.

`SparseNCCLWeightTransferEngine.receive_weights` broadcasts each patch's int32 indices and values
over NCCL (no NCCL on this CPU), then calls `load_checkpoint_weight_patches(self.model, patches)`
with its defaults. This runs that call on the same patches, already in memory as the broadcast
would leave them, and measures it with `_apply_worker.PeakRss` (time and the worker's peak extra
resident memory: the full-shape NaN staging).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._apply_worker import PeakRss, _decoded_patches, _post_load


def sparse_nccl_apply(worker, path: str) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseWeightPatch,
    )
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    model = worker.model_runner.get_model()
    patches = []
    for p in _decoded_patches(path):
        indices = p.indices.to(torch.int32)  # the sender's format: int32 flat indices
        SparseNCCLTrainerWeightTransferEngine._validate_patch(
            SparseWeightPatch(p.name, indices, p.values, tuple(p.shape))
        )
        patches.append(CheckpointWeightPatch(p.name, tuple(p.shape), p.values.dtype, p.values, indices))
    changed = sum(p.values.numel() for p in patches)
    with PeakRss() as m:  # receive_weights' apply, as it calls it
        loaded = load_checkpoint_weight_patches(model, patches)
    # Not part of sparse_nccl: the touched modules' post-load steps (a CPU engine that repacks its
    # linear layers serves the old kernels without them); timed apart.
    post_load_s = _post_load(model, loaded)
    return {"changed": changed, "total_s": m.seconds, "extra": m.extra, "post_load_s": post_load_s}
