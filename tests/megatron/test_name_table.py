"""The hook's Megatron -> HF naming (megatron_hook.families, then mbridge's tables, as `chunk_segments`
runs them) against a table written out by hand, for the local (non-TE) spec that the CPU tests
build and for the Transformer-Engine spec names mbridge's tables use.

Why: the hook's reference export and the hook itself both go through `TENamed`, so a consistent
naming error (the attention and MLP norms swapped, say) is invisible to every test that compares
the two. The table below is written from megatron-core 0.16's layer specs and the HF Llama /
Qwen3-MoE / GLM4-MoE checkpoints (mbridge 0.15.1 conventions), not from the translation code.
Shapes are the tiny families' (tests/harness/tiny_models.py): hidden 128, 4 query heads and 2 kv
heads of 32, FFN 256, 4 experts of FFN 64 (GLM4: one shared expert), vocab 512."""

from __future__ import annotations

import math

import pytest
import torch
from harness.megatron_stub import make_bridge, storage_of, stub_chunk

pytestmark = [pytest.mark.megatron]

H, Q, KV, F, MF, E, V, D = 128, 128, 64, 256, 64, 4, 512, 32

# (megatron name, local shape) -> {HF name: HF shape}; "{i}" is the layer, "{e}" the expert.
MODEL = {
    ("embedding.word_embeddings.weight", (V, H)): {"model.embed_tokens.weight": (V, H)},
    ("decoder.final_layernorm.weight", (H,)): {"model.norm.weight": (H,)},
    ("output_layer.weight", (V, H)): {"lm_head.weight": (V, H)},
}
ATTENTION = {
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", (Q + 2 * KV, H)): {
        "model.layers.{i}.self_attn.q_proj.weight": (Q, H),
        "model.layers.{i}.self_attn.k_proj.weight": (KV, H),
        "model.layers.{i}.self_attn.v_proj.weight": (KV, H),
    },
    ("decoder.layers.{i}.self_attention.linear_proj.weight", (H, Q)): {
        "model.layers.{i}.self_attn.o_proj.weight": (H, Q)
    },
}
INPUT_NORM = {
    "local": {
        ("decoder.layers.{i}.input_layernorm.weight", (H,)): {"model.layers.{i}.input_layernorm.weight": (H,)}
    },
    "te": {
        ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", (H,)): {
            "model.layers.{i}.input_layernorm.weight": (H,)
        }
    },
}
QK_NORM = {
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", (D,)): {
        "model.layers.{i}.self_attn.q_norm.weight": (D,)
    },
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", (D,)): {
        "model.layers.{i}.self_attn.k_norm.weight": (D,)
    },
}
DENSE_MLP = {
    ("decoder.layers.{i}.mlp.linear_fc1.weight", (2 * F, H)): {
        "model.layers.{i}.mlp.gate_proj.weight": (F, H),
        "model.layers.{i}.mlp.up_proj.weight": (F, H),
    },
    ("decoder.layers.{i}.mlp.linear_fc2.weight", (H, F)): {"model.layers.{i}.mlp.down_proj.weight": (H, F)},
}
DENSE_MLP_NORM = {
    "local": {
        ("decoder.layers.{i}.pre_mlp_layernorm.weight", (H,)): {
            "model.layers.{i}.post_attention_layernorm.weight": (H,)
        }
    },
    "te": {
        ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", (H,)): {
            "model.layers.{i}.post_attention_layernorm.weight": (H,)
        }
    },
}
MOE_MLP_NORM = {  # a MoE layer's norm stays its own module in both specs
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", (H,)): {
        "model.layers.{i}.post_attention_layernorm.weight": (H,)
    },
}
ROUTER = {("decoder.layers.{i}.mlp.router.weight", (E, H)): {"model.layers.{i}.mlp.gate.weight": (E, H)}}
EXPERT = {
    "local": {
        ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * MF, H)): {
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": (MF, H),
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight": (MF, H),
        },
        ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight", (H, MF)): {
            "model.layers.{i}.mlp.experts.{e}.down_proj.weight": (H, MF)
        },
    },
    "te": {
        ("decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}", (2 * MF, H)): {
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": (MF, H),
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight": (MF, H),
        },
        ("decoder.layers.{i}.mlp.experts.linear_fc2.weight{e}", (H, MF)): {
            "model.layers.{i}.mlp.experts.{e}.down_proj.weight": (H, MF)
        },
    },
}
SHARED_EXPERT = {
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", (2 * MF, H)): {
        "model.layers.{i}.mlp.shared_experts.gate_proj.weight": (MF, H),
        "model.layers.{i}.mlp.shared_experts.up_proj.weight": (MF, H),
    },
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", (H, MF)): {
        "model.layers.{i}.mlp.shared_experts.down_proj.weight": (H, MF)
    },
}
# GLM4's router bias: a buffer (updated outside the optimizer), HF's e_score_correction_bias.
EXPERT_BIAS = {
    "decoder.layers.{i}.mlp.router.expert_bias": (
        (E,),
        {"model.layers.{i}.mlp.gate.e_score_correction_bias": (E,)},
    )
}


def _layer(kind: str, spec: str) -> dict:
    """The rows of one layer: "dense", "moe" (Qwen3-MoE: q/k norms, no shared expert), "moe_shared" (GLM4)."""
    rows = {**INPUT_NORM[spec], **ATTENTION}
    if kind == "dense":
        return {**rows, **DENSE_MLP_NORM[spec], **DENSE_MLP}
    rows = {**rows, **MOE_MLP_NORM, **ROUTER}
    rows.update(
        {
            (n.replace("{e}", str(e)), s): {h.replace("{e}", str(e)): hs for h, hs in hf.items()}
            for e in range(E)
            for (n, s), hf in EXPERT[spec].items()
        }
    )
    if kind == "moe":
        return {**rows, **QK_NORM}
    return {**rows, **SHARED_EXPERT}


LAYERS = {"llama": ["dense", "dense"], "qwen3_moe": ["moe", "moe"], "glm4_moe": ["dense", "moe_shared"]}


def _table(family: str, spec: str) -> tuple[dict, dict, dict]:
    """(megatron param -> local shape, megatron buffer -> shape, megatron name -> {HF name: HF shape})."""
    params, buffers, names = {}, {}, {}
    rows = [(MODEL, None)] + [(_layer(kind, spec), i) for i, kind in enumerate(LAYERS[family])]
    for table, i in rows:
        for (meg, shape), hf in table.items():
            meg = meg.format(i=i)
            params[meg] = shape
            names[meg] = {h.format(i=i): hs for h, hs in hf.items()}
    if family == "glm4_moe":
        for meg, (shape, hf) in EXPERT_BIAS.items():
            meg = meg.format(i=1)
            buffers[meg] = shape
            names[meg] = {h.format(i=1): hs for h, hs in hf.items()}
    return params, buffers, names


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "glm4_moe"])
def test_megatron_names_map_to_the_hf_names_in_the_table(family: str, spec: str) -> None:
    from megatron_hook.hf_map import Parallel, chunk_segments

    params, buffers, want = _table(family, spec)
    chunk = stub_chunk({n: (s, None) for n, s in params.items()}, layer_numbers=[1, 2], buffers=buffers)
    by_storage = {storage_of(t): n for n, t in chunk.state_dict(keep_vars=True).items()}
    segs = chunk_segments(make_bridge(family), chunk, Parallel(0, 1, 0, 1, 0, 0))
    got: dict[str, dict[str, tuple[int, ...]]] = {}
    for s in segs:
        got.setdefault(by_storage[storage_of(s.tensor)], {})[s.name] = s.full_shape
        # One rank at TP=1: every HF tensor comes whole out of one megatron tensor.
        assert torch.equal(s.global_index(), torch.arange(math.prod(s.full_shape))), s.name
    wrong = {n: (got.get(n), hf) for n, hf in want.items() if got.get(n) != hf}
    assert not wrong, f"megatron name: (translated, table) {wrong}"
    assert set(got) == set(want)
