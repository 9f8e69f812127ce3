"""The HF map without processes: mbridge bridges built for TP=2 with explicit parallel states,
probed with the hook's id tensors, against layouts written out by hand from the field notes
(query groups contiguous in linear_qkv; linear_fc1 shards are [gate_r; up_r]; padded vocab rows
have no HF position); and `Segments` / `check_disjoint` on flat runs."""

from __future__ import annotations

import pytest
import torch

from megatron_hook.hf_map import runs_of
from vllm_delta.sender.shards import Segments, Shard, check_disjoint

pytestmark = [pytest.mark.megatron]


def _bridge(hf_dir, tp_rank: int, vocab_multiple: int | None = None):
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    cfg.rope_theta = 10000.0
    return AutoBridge.from_config(
        cfg,
        parallel_states=ParallelStates(tp_size=2, tp_rank=tp_rank, etp_size=2, etp_rank=tp_rank),
        make_vocab_size_divisible_by=vocab_multiple,
    )


def _param(shape, dim):
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


def _positions(segs: list[Segments]) -> dict[str, list[int]]:
    return {s.name: s.global_index().tolist() for s in segs}


@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_fc1_and_padded_vocab_at_tp2(tiny_model_factory, rank):
    from megatron_hook.hf_map import probe

    hf = tiny_model_factory("llama")  # hidden 128, 4 q heads, 2 kv heads, head_dim 32, ffn 256, vocab 512
    bridge = _bridge(hf, rank)
    # linear_qkv: per query group [q 64 rows; k 32; v 32]; rank r holds query group r.
    qkv = _param((128, 128), 0)
    got = _positions(probe(bridge, "decoder.layers.0.self_attention.linear_qkv.weight", qkv, rank, 2))
    rows = {
        "q_proj": range(64 * rank, 64 * rank + 64),
        "k_proj": range(32 * rank, 32 * rank + 32),
        "v_proj": range(32 * rank, 32 * rank + 32),
    }
    for proj, rs in rows.items():
        want = [r * 128 + c for r in rs for c in range(128)]
        assert got[f"model.layers.0.self_attn.{proj}.weight"] == want, proj
    # linear_fc1: the local [gate_r; up_r], 128 + 128 rows of 128.
    fc1 = _param((256, 128), 0)
    segs = probe(bridge, "decoder.layers.0.mlp.linear_fc1.weight", fc1, rank, 2)
    got = _positions(segs)
    want = list(range(rank * 128 * 128, (rank + 1) * 128 * 128))
    assert got == {"model.layers.0.mlp.gate_proj.weight": want, "model.layers.0.mlp.up_proj.weight": want}
    assert [s.tensor.data_ptr() for s in segs] == [fc1.data_ptr(), fc1.data_ptr() + 128 * 128 * 2]  # views
    # Padded vocab (512 -> 768 at a multiple of 384): rank 1's rows 384..767 hold HF rows 384..511 only.
    padded = _bridge(hf, rank, vocab_multiple=384)
    padded.vocab_size, padded.padded_vocab_size = 512, 768
    emb = _param((384, 128), 0)
    got = _positions(probe(padded, "embedding.word_embeddings.weight", emb, rank, 2))
    rows = range(0, 384) if rank == 0 else range(384, 512)
    assert got == {"model.embed_tokens.weight": [r * 128 + c for r in rows for c in range(128)]}


def test_segments_map_and_disjointness():
    full = torch.arange(24).view(4, 6)
    pos = torch.tensor([6, 7, 8, 18, 19, 2])  # three runs, local order
    seg = Segments("w", full.view(-1)[pos], (4, 6), runs_of(pos))
    assert seg.runs == ((6, 3), (18, 2), (2, 1)) and runs_of(pos) == seg.runs
    assert torch.equal(seg.to_global(torch.arange(6)), pos)
    assert torch.equal(full.view(-1)[seg.global_index()], seg.tensor)
    other = Segments("w", torch.zeros(2), (4, 6), runs_of(torch.tensor([9, 10])))
    row = Shard.narrow("w", torch.zeros(1, 6), (4, 6), 0, 3)  # row 3 = flat 18..23: overlaps seg
    assert check_disjoint([seg.describe(), other.describe()]) == {"w": 8 / 24}
    with pytest.raises(ValueError, match="both hold"):
        check_disjoint([seg.describe(), row.describe()])
    with pytest.raises(ValueError, match="overlap"):
        Segments("w", torch.zeros(4), (4, 6), ((0, 2), (1, 2)))
