"""Smoke tests: real megatron-core trains a tiny GPTModel on CPU under gloo (via the test-only
shim in harness/megatron_cpu.py). Each worker asserts; failures propagate through spawn()."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from harness import megatron_cpu  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]

LR = 1e-2  # large enough that every bf16 element with a nonzero grad moves (norm weights = 1.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16).clone()


def _gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    t = t.to(torch.int32).contiguous()
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(out, t, group=group)
    return out


def _step_worker(rank, world_size, port, tp, ep, num_experts, distopt):
    from megatron.core import parallel_state as ps

    megatron_cpu.init_distributed(rank, world_size, port, tp=tp, ep=ep)
    model, opt, gpt = megatron_cpu.build_gpt_model(
        lr=LR, num_experts=num_experts, use_distributed_optimizer=distopt, overlap_param_gather=distopt
    )
    params = dict(gpt.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    before = {n: _bits(p) for n, p in params.items()}

    # Different data per DP rank, so the gradient all-reduce / reduce-scatter matters.
    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    loss = megatron_cpu.train_step(model, opt, tokens)
    if distopt:
        # With overlap_param_gather only this rank's shard is updated until the next forward;
        # finish the all-gather now (what Megatron-LM's force_param_sync does).
        model.start_param_sync(force_sync=True)

    assert math.isfinite(loss), loss
    for name, p in params.items():
        changed = (_bits(p) != before[name]).sum().item()
        assert changed > 0, f"rank {rank}: {name} {tuple(p.shape)} unchanged after the step"
        if "word_embeddings" not in name:  # embeddings: only rows of tokens that were seen
            # Adam's first step moves each element by ~LR; a few with tiny grads stay put.
            assert changed >= 0.9 * p.numel(), f"rank {rank}: {name} {changed}/{p.numel()} moved"

    if tp > 1:
        qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == (128 // tp, 64), qkv.shape
        shards = _gather(_bits(qkv), ps.get_tensor_model_parallel_group())
        assert not torch.equal(shards[0], shards[1]), "TP shards are identical"
        losses = _gather(torch.tensor([loss]).view(torch.int32), ps.get_tensor_model_parallel_group())
        assert torch.equal(losses[0], losses[1]), "TP ranks disagree on the loss"
    if ps.get_data_parallel_world_size() > 1:  # replicas must agree bitwise after the step
        dp = ps.get_data_parallel_group()
        for name, p in params.items():
            if "experts" in name:
                continue  # expert params are sharded over EP, not replicated over DP
            reps = _gather(_bits(p), dp)
            assert all(torch.equal(reps[0], r) for r in reps[1:]), f"{name} differs across DP"
    if num_experts:
        n_local = num_experts // ep
        local = [n for n in params if ".local_experts." in n and n.startswith("decoder.layers.0.")]
        assert len(local) == 2 * n_local, local


def test_gpt_step_world_size_1():
    megatron_cpu.spawn(_step_worker, 1, 1, 1, None, False)


def test_gpt_step_tp2():
    megatron_cpu.spawn(_step_worker, 2, 2, 1, None, False)


def test_gpt_step_dp2_distributed_optimizer_overlap_param_gather():
    megatron_cpu.spawn(_step_worker, 2, 1, 1, None, True)


def test_moe_gpt_step_ep2_alltoall():
    megatron_cpu.spawn(_step_worker, 2, 1, 2, 4, False)


def test_worker_failure_propagates():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        megatron_cpu.spawn(_fail_on_rank_1, 2)


def _fail_on_rank_1(rank, world_size, port):
    if rank == 1:
        raise ValueError("boom")
