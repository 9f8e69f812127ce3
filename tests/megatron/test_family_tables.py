"""The hook's naming and refusals for DeepSeek-V3 (MLA, MTP), legacy GroupedMLP, ETP and a vocab padded
by the trainer, on megatron-core's own modules built on `meta` in this process (torch's `fake`
process group; no collective runs) or on stand-in chunks, against tables the translation code
does not produce:

- megatron-core's own local -> TE remap (`get_gpt_modelopt_spec(remap_te_layernorm=True)`, the
  `sharded_state_dict_keys_map` megatron uses to load TE checkpoints into local-spec models);
- the HF names and shapes of transformers' DeepseekV3ForCausalLM built on `meta`.
The end-to-end counterparts (real training, real export) are in test_families.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness.megatron_cpu import meta_chunk, tiny_deepseek_v3_config
from harness.megatron_stub import make_bridge, stub_chunk

pytestmark = [pytest.mark.megatron]


def _megatron_remap(gpt, bridge) -> dict[str, str]:
    """{local name: TE name} for every norm megatron-core's own remap table renames."""
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    specs = get_gpt_modelopt_spec(bridge.config, remap_te_layernorm=True).layer_specs
    layers = {f"decoder.layers.{i}.": spec for i, spec in enumerate(specs)}
    layers.update(
        {
            f"mtp.layers.{k}.transformer_layer.": specs[-1]  # MTP reuses the last layer's spec
            for k in range(bridge.config.mtp_num_layers or 0)
        }
    )
    out = {}
    for name in gpt.state_dict():
        for prefix, spec in layers.items():
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                for src, dst in spec.submodules.sharded_state_dict_keys_map.items():
                    if rest.startswith(src):
                        out[name] = prefix + dst + rest[len(src) :]
    return out


def test_mla_and_mtp_norms_are_renamed_as_megatron_remaps_them():
    from megatron_hook.families import to_te_names

    with meta_chunk(tiny_deepseek_v3_config(layers=2, mtp_layers=1)) as (gpt, bridge):
        want = _megatron_remap(gpt, bridge)
        got = to_te_names(n for n in gpt.state_dict() if "_extra_state" not in n)
    assert any(n.startswith("mtp.") for n in want) and any("q_layernorm" in n for n in want)
    renamed = {n: te for n, te in got.items() if te != n and ".experts." not in n}
    assert renamed == want
    assert got["decoder.layers.0.input_layernorm.weight"] == "decoder.layers.0.input_layernorm.weight"


def _hf_table(cfg) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names and shapes of transformers' model (its fused experts split per expert)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, H]
            for e in range(t.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{name[: -len('gate_up_proj')]}{e}.{proj}.weight"] = (t.shape[1] // 2, t.shape[2])
        elif name.endswith("experts.down_proj"):  # [E, H, F]
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            out[name] = tuple(t.shape)
    return out


def test_mla_layers_map_onto_transformers_names_and_shapes():
    from megatron_hook.hf_map import Parallel, chunk_segments

    cfg = tiny_deepseek_v3_config(layers=2)
    with meta_chunk(cfg) as (gpt, bridge):
        segs = chunk_segments(bridge, gpt, Parallel(0, 1, 0, 1, 0, 0))
    got = {s.name: s.full_shape for s in segs}
    assert got == _hf_table(cfg)
    for s in segs:  # one rank at TP=1: each HF tensor whole, from one megatron tensor
        assert sum(length for _, length in s.runs) == math.prod(s.full_shape), s.name


def test_legacy_grouped_mlp_is_refused_naming_the_module(monkeypatch):
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    from harness.tiny_models import SPECS

    from megatron_hook.hf_map import Parallel, chunk_segments

    monkeypatch.setattr(gg, "assert_grouped_gemm_is_available", lambda: None)  # built, never run
    cfg = SPECS["qwen3_moe"].make_config()
    cfg.rope_theta = 10000.0
    with meta_chunk(cfg, extra_args=dict(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)) as (
        gpt,
        bridge,
    ):
        assert "decoder.layers.0.mlp.experts.weight1" in dict(gpt.named_parameters())
        with pytest.raises(NotImplementedError, match=r"decoder\.layers\.0\.mlp\.experts: legacy GroupedMLP"):
            chunk_segments(bridge, gpt, Parallel(0, 1, 0, 1, 0, 0))


def test_expert_tensor_parallel_without_tp_is_refused_naming_the_module():
    from megatron_hook.hf_map import Parallel, chunk_segments

    chunk = stub_chunk(
        {"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": ((64, 128), 0)}, layer_numbers=[1]
    )
    bridge = make_bridge("qwen3_moe", tp_size=1, etp_size=2, etp_rank=1)
    with pytest.raises(
        NotImplementedError, match=r"decoder\.layers\.0\.mlp\.experts: expert tensor parallel size 2"
    ):
        chunk_segments(bridge, chunk, Parallel(0, 1, 1, 2, 0, 0))


@pytest.mark.parametrize("rank", [0, 1])
def test_vocab_padding_is_read_from_the_tensors(rank):
    """768 rows over TP=2 (padded by the trainer); the bridge was made without padding, as slime makes it."""
    from megatron_hook.hf_map import Parallel, chunk_segments

    params = {n: ((384, 128), 0) for n in ("embedding.word_embeddings.weight", "output_layer.weight")}
    chunk = stub_chunk(params)
    bridge = make_bridge("llama", tp_size=2, tp_rank=rank)
    segs = chunk_segments(bridge, chunk, Parallel(rank, 2, rank, 2, 0, 0))
    rows = range(0, 384) if rank == 0 else range(384, 512)
    for s in segs:
        assert s.full_shape == (512, 128)
        assert s.global_index().tolist() == [r * 128 + c for r in rows for c in range(128)], s.name
    assert bridge.padded_vocab_size is None  # the caller's bridge is left as it was
    bridge.make_vocab_size_divisible_by, bridge.vocab_size, bridge.padded_vocab_size = 512, 512, 1024
    with pytest.raises(ValueError, match="pads the vocab to 1024 rows but the model's tensors hold 768"):
        chunk_segments(bridge, chunk, Parallel(rank, 2, rank, 2, 0, 0))


@pytest.mark.parametrize("first_stage", [True, False])
def test_an_mtp_stages_embedding_copy_is_not_shipped(first_stage):
    """A last stage holding MTP has its own copy of the word embeddings (megatron ties it to the
    first stage's); only the first stage ships it. test_families.py runs this at PP=2 for real."""
    from megatron_hook.hf_map import Parallel, chunk_segments

    chunk = stub_chunk(
        {n: ((512, 128), 0) for n in ("embedding.word_embeddings.weight", "output_layer.weight")}
    )
    chunk.pre_process = first_stage
    names = {s.name for s in chunk_segments(make_bridge("llama"), chunk, Parallel(0, 1, 0, 1, 0, 0))}
    assert names == ({"model.embed_tokens.weight", "lm_head.weight"} if first_stage else {"lm_head.weight"})
