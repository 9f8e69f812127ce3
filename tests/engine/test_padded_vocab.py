"""Vocabularies vLLM pads: its embedding loader zero-fills the padding rows, and updates still apply.

vLLM pads the vocab to a multiple of 64 per TP rank and `VocabParallelEmbedding.weight_loader`
fills the rows past the checkpoint's with 0. The probe allows a constant fill of elements that no
checkpoint element reaches (engine/placement.py `Fill`) and refuses any other in-place write.

Light: vLLM's own embedding class at vocab 50257 (GPT-2's) on `meta` at TP 1, 2 and 8, its map
checked against the real loader and across ranks; synthetic loaders whose fills are not padding.
Heavy: real engines on a tiny Llama with vocab 500 (512 served), untied and tied, at TP=2.
Each starts on the FINAL checkpoint (the reference: vLLM's own fresh load, digests and greedy
output), reloads BASE with vLLM's `reload_weights`, then applies a base-relative delta and an
overwrite delta touching embed and lm_head rows (the last row before the padding, the TP
boundary): digests, greedy tokens and logprobs must equal the reference.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness.cli_diff import add_digests, diff
from harness.fresh_load import save_checkpoint
from harness.perturb import perturb_checkpoint
from harness.tiny_models import _common, train_tokenizer
from harness.vllm_engine import greedy, start_llm
from safetensors.torch import load_file
from torch import nn

from vllm_delta.engine.digests import check_coverage, check_partials, coverage, mismatches
from vllm_delta.engine.intercept import storages_of
from vllm_delta.engine.map_check import check_map
from vllm_delta.engine.placement import Fill
from vllm_delta.engine.probe import build_placement
from vllm_delta.wire import load_manifest

VOCAB = 500  # served as 512: 12 padding rows (TP=2: rank 1 holds 244 rows and 12 of padding)
HIDDEN = 128


# ---- light: vLLM's embedding loader at GPT-2's vocab, on meta ------------------------------------


def vllm_embedding(vocab: int, hidden: int, rank: int, tp: int, device: str = "meta"):
    """vLLM's VocabParallelEmbedding for one TP rank (its own padding and shard arithmetic)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    with torch.device(device):
        return VocabParallelEmbedding(
            vocab,
            hidden,
            params_dtype=torch.bfloat16,
            parallel_group=SimpleNamespace(rank_in_group=rank, world_size=tp),
        )


def loader_of(module) -> callable:
    def load_weights(weights):
        for _, w in weights:
            module.weight_loader(module.weight, w)

    return load_weights


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpt2_vocab_padding_fill_is_allowed_and_ignored_by_the_map(tp):
    vocab, hidden = 50257, 16
    checkpoint = {"wte": ((vocab, hidden), torch.bfloat16)}
    replies = []
    for rank in range(tp):
        emb = vllm_embedding(vocab, hidden, rank, tp)
        rows = emb.weight.shape[0]  # 50304 / tp: padded to 64, then split
        placements = build_placement(loader_of(emb), storages_of([("w", emb.weight)]), checkpoint)
        p = placements["wte"]
        assert p.fallback_reason is None, p.fallback_reason
        first = rank * rows  # this rank's vocab range, from the padded split
        held = max(0, min(vocab, first + rows) - first)
        (seg,) = p.segments
        assert (seg.sizes, seg.src_offset, seg.dst_offset) == ((held, hidden), first * hidden, 0)
        if held < rows:  # the padding rows, and only they, are filled (with 0)
            assert p.fills == [
                Fill("w", (rows - held, hidden), held * hidden, (hidden, 1), 0, "aten.fill_.Scalar")
            ]
        else:
            assert p.fills == []
        replies.append({"rank": rank, "coverage": coverage(placements), "unread": [], "fallback": []})
    report = check_coverage(replies, {"wte": (vocab, hidden)})
    assert report["ok"], report


@pytest.mark.parametrize("rank", [0, 1])
def test_padded_map_agrees_with_vllms_loader_on_random_values(rank):
    """map_check runs vLLM's loader for real (padding filled) beside the map (segments and fills)."""
    vocab, hidden = 50257, 16
    emb = vllm_embedding(vocab, hidden, rank, 2, device="cpu")
    checkpoint = {"wte": ((vocab, hidden), torch.bfloat16)}
    placements = build_placement(loader_of(emb), storages_of([("w", emb.weight)]), checkpoint)
    assert check_map(loader_of(emb), {"w": emb.weight}, placements, checkpoint) == {}


class Filler(nn.Module):
    """A packed destination `p` (rows 0-3 from `a`, rows 8-15 from `b`) and loaders that fill it."""

    def __init__(self, fill: str) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(16, 4), requires_grad=False)
        self.fill = fill

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "a":
                self.p.data[:4].copy_(w)
            elif name == "b":
                self.p.data[8:].copy_(w)
                if self.fill == "padding":
                    self.p.data[4:8].fill_(0)
                elif self.fill == "reached":  # rows 3..7: row 3 holds a's elements
                    self.p.data[3:8].fill_(0)
                elif self.fill == "own":  # row 8 holds b's own elements
                    self.p.data[4:9].fill_(0)
                elif self.fill == "follows":  # a value read from the checkpoint tensor
                    self.p.data[4:8].fill_(w.reshape(-1)[5].item())
                elif self.fill == "tensor":
                    self.p.data[4:8].fill_(w[0, 0])


CKPT = {"a": ((4, 4), torch.float32), "b": ((8, 4), torch.float32)}


def test_a_fill_of_rows_no_checkpoint_element_reaches_is_mapped():
    m = Filler("padding")
    placements = build_placement(m.load_weights, storages_of(m.named_parameters()), CKPT)
    assert all(p.fallback_reason is None for p in placements.values())
    assert placements["b"].fills == [Fill("p", (4, 4), 16, (4, 1), 0, "aten.fill_.Scalar")]
    assert check_map(m.load_weights, dict(m.named_parameters()), placements, CKPT) == {}


@pytest.mark.parametrize("fill", ["reached", "own", "follows", "tensor"])
def test_any_other_fill_is_refused_as_before(fill):
    """A fill meeting another tensor's rows or its own, or a value from the checkpoint, falls back."""
    m = Filler(fill)
    placements = build_placement(m.load_weights, storages_of(m.named_parameters()), CKPT)
    assert placements["a"].fallback_reason is None
    reason = placements["b"].fallback_reason
    assert reason and not placements["b"].segments and not placements["b"].fills, reason
    assert "writes parameter p" in reason or "follow the checkpoint" in reason, reason


# ---- heavy: real engines, vocab 500 ------------------------------------------------------------


def make_vocab_model(out: Path, tied: bool) -> Path:
    """A tiny Llama with vocab 500 (the tokenizer has fewer tokens), random bf16 weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        intermediate_size=256,
        **{**_common(), "vocab_size": VOCAB, "hidden_size": HIDDEN, "tie_word_embeddings": tied},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out)
    train_tokenizer(out)
    return out


ROWS = [0, 1, 255, 256, 498, 499]  # first rows, the TP=2 boundary, the rows before the padding


def make_chain(root: Path, tied: bool) -> tuple[Path, list[Path], Path]:
    """BASE -> MID (a few ULPs everywhere: ulp_zstd) -> FINAL (embed / lm_head rows replaced: indices)."""
    base = make_vocab_model(root / "base", tied)
    mid = perturb_checkpoint(base, root / "mid", density=0.05, seed=1)
    weights = load_file(mid / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name][ROWS] = (torch.randn(len(ROWS), HIDDEN, generator=gen) * 0.5).to(torch.bfloat16)
    final = save_checkpoint(weights, mid, root / "final")
    deltas = []
    for version, (old, new, encoding) in enumerate(
        [(base, mid, "ulp_zstd"), (mid, final, "indices")], start=1
    ):
        out = root / f"delta_v{version}"
        diff(old, new, out, encoding, version, version - 1)
        add_digests(out, old, new)
        deltas.append(out)
    return base, deltas, final


@pytest.mark.heavy
@pytest.mark.engine
# TP=2 only: its last rank holds the checkpoint's tail rows and then the padding, as TP=1's one rank
# does, and adds the TP boundary; the maps at TP 1, 2 and 8 are the light tests' (about 40 s an engine).
@pytest.mark.parametrize("tied,tp", [(False, 2), (True, 2)], ids=["untied-tp2", "tied-tp2"])
def test_padded_vocab_engine_matches_a_fresh_load(tied, tp, tmp_path):
    base, deltas, final = make_chain(tmp_path, tied)
    with start_llm(final, tp=tp, delta=True) as llm:
        status = llm.collective_rpc("delta_probe")
        assert all(s["fallback"] == {} and s["refused"] == {} for s in status), status
        reference = llm.collective_rpc("compute_weight_checksums")
        reference_out = greedy(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(base)})
        reloaded = llm.collective_rpc("compute_weight_checksums")
        for got, want in zip(reloaded, reference):  # every tensor moved (MID's ULPs), embed rows too
            assert got.keys() == want.keys() and not [n for n in want if got[n] == want[n]]
        base_out = greedy(llm)
        llm.collective_rpc("delta_set_peers", args=(llm.collective_rpc("delta_coverage"),))
        for version, path in enumerate(deltas, start=1):
            request = {
                "id": f"v{version}",
                "path": str(path),
                "version": version,
                "base_version": version - 1,
                "files": None,
                "max_staged_bytes": 1 << 20,
            }
            prepared = llm.collective_rpc("delta_prepare", args=(request,))
            assert all(r["ok"] and r["fallback"] == [] for r in prepared), prepared
            assert check_partials(prepared) == 2 * len(
                load_manifest(path).params
            )  # counted once across ranks
            committed = llm.collective_rpc("delta_commit", args=(request["id"],))
            assert all(r["ok"] for r in committed), committed
        checked, bad = mismatches(llm.collective_rpc("delta_verify"))
        applied = llm.collective_rpc("compute_weight_checksums")
        applied_out = greedy(llm)
    assert checked == len(load_file(final / "model.safetensors")) and bad == [], bad  # every tensor, whole
    for rank, (got, want) in enumerate(zip(applied, reference)):
        assert got.keys() == want.keys()
        assert not sorted(n for n in want if got[n] != want[n]), f"rank {rank}"
    assert applied_out == reference_out
    assert base_out != reference_out, "the served output must follow the weights"
