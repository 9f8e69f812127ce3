"""The hook on real megatron-core (CPU, gloo) for the families whose layout mbridge's tables and
megatron's stage placement make special, against mbridge's own export bit for bit:

- DeepSeek-V3 (MLA + MTP) at PP=2: megatron-core's MLA built from its local spec (q/kv LoRA norms
  are their own modules there, fused into `linear_q_up_proj` / `linear_kv_up_proj` in the TE spec
  mbridge's tables name; `input_layernorm` stays its own module in both), with one MTP layer on
  the last stage, which holds a tied copy of the word embeddings. mbridge 0.15.1 names MTP only
  for DeepSeek-V3's 61 layers (`_convert_mtp_param` asserts it), so the tiny model has 61 toy
  layers (59 dense, then MoE). The embedding elements are shipped once, under both the names
  mbridge exports for them (`model.embed_tokens` and the MTP layer's `model.layers.61.embed_tokens`).
- A vocab padded by the trainer (Megatron-LM / slime: 512 -> 768 rows at TP=2) with a bridge that
  knows nothing of the padding: the map takes it from the model's tensor shapes.

Why 61 layers is affordable: the layers are toy-sized; most of the cost is mbridge's export.
"""

from __future__ import annotations

import pytest
from family_workers import family_worker
from harness import megatron_cpu

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]
STEPS = 2


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return megatron_cpu.make_tiny_deepseek_v3(
        tmp_path_factory.mktemp("dsv3") / "hf", layers=61, mtp_layers=1, dense_layers=59
    )


def test_deepseek_v3_mla_mtp_pp2(deepseek_v3):
    extra = dict(
        moe_router_bias_update_rate=1e-2,
        moe_shared_expert_overlap=False,
        num_layers_in_first_pipeline_stage=30,
    )
    mtp = [
        "model.layers.61.eh_proj.weight",
        "model.layers.61.self_attn.q_a_layernorm.weight",
        "model.layers.61.mlp.experts.0.gate_proj.weight",
        "model.layers.61.embed_tokens.weight",
        "model.layers.61.shared_head.head.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.60.mlp.gate.e_score_correction_bias",
    ]
    megatron_cpu.spawn(family_worker, 2, str(deepseek_v3), 1, 2, STEPS, extra, None, False, mtp, timeout=400)


def test_vocab_padded_by_the_trainer(tiny_model_factory):
    hf = str(tiny_model_factory("llama"))
    megatron_cpu.spawn(family_worker, 2, hf, 2, 1, STEPS, None, 384, True, ["lm_head.weight"], timeout=300)
