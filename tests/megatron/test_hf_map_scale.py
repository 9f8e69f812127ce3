"""Registration in O(rows) (issue 18, "Why 1"): the block probe against the element-wise reference, and at
355B.

- `BlockIds` against real torch ops on the ids it stands for.
- `hf_map.chunk_segments` against `reference_probe.chunk_segments_full` (one int64 id per element
  through the same mbridge calls), on real mbridge + megatron-core models built on `meta` as ranks of
  TP x PP x EP jobs, every param kind checked present.
- GLM-4.7-355B's worst rank in the launcher's layout at full shape: segment and run counts from a
  formula over the published config (not from the code under test), and no tensor allocated during
  registration holds more than TP x the rows of the largest param (the element-wise probe
  allocated TP x its elements).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hook.block_ids import BlockIds

pytestmark = [pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[2]


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_block_ids_follow_torch():
    a, b = BlockIds.arange(0, (6, 8)), BlockIds.arange(48, (6, 8))
    ra, rb = torch.arange(48).view(6, 8), torch.arange(48, 96).view(6, 8)
    cases = {
        "cat0": (torch.cat([a, b], dim=0), torch.cat([ra, rb], dim=0)),
        "cat1": (torch.cat([a, b], dim=1), torch.cat([ra, rb], dim=1)),
        "qkv": (
            torch.cat([a, b]).view(2, -1, 8)[:, 2:5].reshape(-1, 8),
            torch.cat([ra, rb]).view(2, -1, 8)[:, 2:5].reshape(-1, 8),
        ),
        "chunk": (a.chunk(2)[1], ra.chunk(2)[1]),
        "chunk_uneven": (a.chunk(4, dim=1)[-1], ra.chunk(4, dim=1)[-1]),
        "split_last": (a.split([3, 5], dim=-1)[1], ra.split([3, 5], dim=-1)[1]),
        "slice_last": (a[:, 3:7], ra[:, 3:7]),
        "slice_step": (a[1:5:2, ::3], ra[1:5:2, ::3]),
        "int_last": (a[..., 5], ra[..., 5]),
        "int_first": (a[2], ra[2]),
        "flat": (a.reshape(-1)[5:29], ra.reshape(-1)[5:29]),
        "vocab": (torch.cat([a, b])[:7], torch.cat([ra, rb])[:7]),
    }
    for name, (got, want) in cases.items():
        assert got.shape == want.shape and torch.equal(_materialize(got), want), name
    assert a.width == 8 and a[:, 4:].width == 4 and a[:, 3:].width == 1  # refined only as far as needed


def test_block_ids_refuse_what_they_do_not_model():
    a = BlockIds.arange(0, (4, 4))
    with pytest.raises(NotImplementedError, match="stack"):
        torch.stack([a, a])
    with pytest.raises(NotImplementedError, match="advanced index"):
        a[torch.tensor([0, 2])]
    with pytest.raises(AttributeError):
        a.t()


def test_probe_refuses_a_rule_it_does_not_model():
    """A family whose conversion transposes (none in mbridge 0.15.1's LLM bridges) is refused, named."""
    from megatron_hook.hf_map import probe

    class Transposing:  # stands in for an mbridge family with a rule the block probe lacks
        def _weight_to_hf_format(self, name, w):
            return ["x.weight"], [w.t()]

    with pytest.raises(NotImplementedError, match="decoder.layers.0.odd.weight"):
        probe(Transposing(), "decoder.layers.0.odd.weight", torch.empty(4, 6, device="meta"), 0, 1)


_KINDS = {  # every param kind registration must map, by its TE global name
    "embedding": r"^embedding\.word_embeddings\.weight$",
    "output": r"^output_layer\.weight$",
    "final_norm": r"^decoder\.final_layernorm\.weight$",
    "qkv": r"linear_qkv\.weight$",
    "qkv_bias": r"linear_qkv\.bias$",
    "qkv_norm": r"linear_qkv\.layer_norm_weight$",
    "qk_norms": r"(q|k)_layernorm\.weight$",
    "proj": r"linear_proj\.weight$",
    "dense_fc1": r"\.mlp\.linear_fc1\.weight$",
    "dense_fc2": r"\.mlp\.linear_fc2\.weight$",
    "dense_norm": r"\.mlp\.linear_fc1\.layer_norm_weight$",
    "moe_norm": r"pre_mlp_layernorm\.weight$",
    "router": r"router\.weight$",
    "expert_bias": r"router\.expert_bias$",
    "expert_fc1": r"experts\.linear_fc1\.weight\d+$",
    "expert_fc2": r"experts\.linear_fc2\.weight\d+$",
    "shared_fc1": r"shared_experts\.linear_fc1\.weight$",
    "shared_fc2": r"shared_experts\.linear_fc2\.weight$",
}
_SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    head_dim=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=500,
    num_hidden_layers=4,
)
_LAYOUTS = [  # (tp, pp, ep, vocab multiple); every rank ships something (its experts at least)
    (2, 2, 2, 64),  # every dim split; padded vocab; embedding and output on different stages
    (4, 1, 4, None),  # one query group per rank
    (1, 1, 4, 128),  # experts split; DP 4: only rank 0 ships the rest, whole
]


def _key(s):
    return s.name, s.full_shape, s.runs, tuple(s.tensor.shape), s.tensor.stride(), s.tensor.storage_offset()


@pytest.mark.parametrize("family", ["glm-4.7-355b-a32b", "qwen3-235b-a22b"])
def test_block_probe_equals_element_probe(family):
    from harness.megatron_meta import meta_rank
    from reference_probe import chunk_segments_full

    from megatron_hook.hf_map import Parallel, chunk_segments, shipped

    configs = _module("benchmarks/scale_configs.py")
    fields = {**configs.MODELS[family], **_SMALL}
    fields.update(
        {"n_routed_experts": 8, "first_k_dense_replace": 1}
        if "n_routed_experts" in fields
        else {"num_experts": 8}
    )
    seen, checked = set(), 0
    for tp, pp, ep, multiple in _LAYOUTS:
        world = pp * max(tp, ep)
        for rank in range(world):
            with meta_rank(
                fields, world=world, rank=rank, tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=multiple
            ) as (gpt, bridge):
                par = Parallel.current()
                got = [_key(s) for s in chunk_segments(bridge, gpt, par)]
                assert got and got == [_key(s) for s in chunk_segments_full(bridge, gpt, par)], (
                    tp,
                    pp,
                    ep,
                    rank,
                )
                seen |= {
                    k
                    for name, *_ in shipped(bridge, gpt, par)
                    for k, pat in _KINDS.items()
                    if re.search(pat, name)
                }
                checked += 1
    kinds = set(_KINDS) - (
        {"qkv_bias", "shared_fc1", "shared_fc2", "expert_bias", "dense_fc1", "dense_fc2", "dense_norm"}
        if family.startswith("qwen3")
        else set()
    )
    assert seen == kinds and checked == 12


class _LargestAlloc(TorchDispatchMode):
    """The most elements any op's tensor output holds (meta outputs are views of weights: skipped);
    fails at the first output over `limit`, before an O(elements) probe can exhaust the host."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
                assert self.largest <= self.limit, (
                    f"{func} allocated {t.numel()} elements during registration"
                )
        return out


def test_glm_355b_worst_rank_registers_in_rows_not_elements():
    """Full shape, launcher layout (TP4 PP4 EP16 on 64 ranks), last PP stage (23 MoE layers + lm_head),
    through the benchmark's own `register_rank` (its small form)."""
    from megatron_hook.hf_map import chunk_segments, local_tensors

    cfg = _module("benchmarks/scale_configs.py").GLM_4_7_355B
    bench = _module("benchmarks/scale_trainer.py")
    layout = bench.launcher_layout()
    tp, pp, ep = layout["tp"], layout["pp"], layout["ep"]
    assert (layout["world"], tp, pp, ep) == (64, 4, 4, 16)
    seen = {}

    def counted(bridge, gpt, par):
        seen["rows"] = max(t.numel() // t.shape[-1] for t in local_tensors(gpt).values() if t.dim() > 1)
        seen["elements"] = sum(t.numel() for t in local_tensors(gpt).values())
        with _LargestAlloc(tp * seen["rows"]) as mode:
            segs = chunk_segments(bridge, gpt, par)
        seen["largest"] = mode.largest
        return segs

    got = bench.register_rank(cfg, layout, bench.stage_ranks(layout)[-1], probe=counted)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"] // pp
    # per MoE layer: input norm, q/k/v weights and biases, q/k norms, o_proj, post-attention norm,
    # router and its expert bias, 3 per local expert, shared gate/up and down.
    per_layer = 1 + 3 + 3 + 2 + 1 + 1 + 1 + 1 + 3 * cfg["n_routed_experts"] // ep + 2 + 1
    # o_proj and shared down_proj are row-parallel: one run per HF row (h rows each); the rest whole.
    per_layer_runs = per_layer - 2 + 2 * h
    assert got["segments"] == layers * per_layer + 2  # + final norm + lm_head
    assert got["runs"] == layers * per_layer_runs + 2
    assert got["shipped_elements"] == seen["elements"]  # TP rank 0 of the stage ships all it holds
    assert seen["rows"] == cfg["vocab_size"] // tp and seen["largest"] == tp * seen["rows"]  # lm_head, merged


@pytest.mark.parametrize("family", ["glm-4.7-355b-a32b", "qwen3-235b-a22b"])
def test_block_fp8_families_shard_into_whole_blocks(family):
    """Why the hook refuses a shard that cuts a 128x128 block instead of gathering it: the block-fp8
    models (GLM-4.7-FP8, Qwen3-235B-A22B-FP8) at full shape in the launcher's TP4 EP16 layout never cut
    one. Every projection segment of the first stage's first 4 layers (GLM's dense and MoE layers, both
    models' attention, experts and shared experts) on TP rank 0 is whole blocks (the other TP ranks'
    slices are the same size), as `register()` checks it."""
    from megatron_hook.hf_map import probe
    from vllm_delta.sender.fp8_quant import block_layout

    cfg = _module("benchmarks/scale_configs.py").MODELS[family]
    bench = _module("benchmarks/scale_trainer.py")
    layout = bench.launcher_layout()
    if cfg["num_hidden_layers"] % layout["pp"]:  # Qwen3-235B's 94 layers: two stages
        layout = {**layout, "pp": 2, "world": layout["world"] // layout["pp"] * 2}
    checked: list[str] = []

    def aligned(bridge, gpt, par):
        segs = bench._on_first_layers(probe, 4)(bridge, gpt, par)
        for s in segs:
            if s.name.endswith("_proj.weight"):
                block_layout(s, (128, 128))  # raises, naming the tensor and the rows and columns held
                checked.append(s.name)
        return segs

    bench.register_rank(cfg, layout, 0, probe=aligned)
    kinds = {
        k for k in ("q_proj", "k_proj", "o_proj", "experts", "shared_expert") if any(k in n for n in checked)
    }
    assert kinds == {"q_proj", "k_proj", "o_proj", "experts"} | (
        {"shared_expert"} if "glm" in family else set()
    )


def _materialize(ids: BlockIds) -> torch.Tensor:
    """The per-element ids."""
    return (ids.starts.unsqueeze(-1) + torch.arange(ids.width)).reshape(ids.shape)
