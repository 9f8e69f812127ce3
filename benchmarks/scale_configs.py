"""The production models' published `config.json` values, shared by the receiver and trainer scale harnesses.

Why: a scale claim is only as good as its shapes. These are the fields that decide tensor counts and
shapes, copied from the models' published configs (zai-org/GLM-4.7, Qwen/Qwen3-235B-A22B,
deepseek-ai/DeepSeek-V3; cross-checked against slime's Megatron launch scripts for the same models).
`shrunk()` keeps every count (layers, experts, heads, MTP) and shrinks only the widths, for the
tensor-count-true engines a CPU can load.
"""

from __future__ import annotations

import copy
from typing import Any

GLM_4_7_355B: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 151552,
    "attention_bias": True,
    "use_qk_norm": True,
    "partial_rotary_factor": 0.5,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "torch_dtype": "bfloat16",
}

QWEN3_235B_A22B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "attention_bias": False,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}

MODELS: dict[str, dict[str, Any]] = {
    "glm-4.7-355b-a32b": GLM_4_7_355B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "deepseek-v3": DEEPSEEK_V3,
}


def shrunk(
    config: dict[str, Any], *, hidden: int = 64, ffn: int = 64, head_dim: int = 16, vocab: int | None = None
) -> dict[str, Any]:
    """Same layer, expert, head and MTP counts; widths shrunk so a CPU engine can hold the model.

    MLA keeps its structure (q and kv LoRA ranks, rope/nope split) at shrunk sizes; the caller picks
    sizes the backend accepts (vLLM's CPU MLA decode kernel needs kv_lora_rank + rope dim = 576).
    """
    out = copy.deepcopy(config)
    out.update({"hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": ffn})
    if "head_dim" in out:
        out["head_dim"] = head_dim
    if vocab is not None:
        out["vocab_size"] = vocab
    out.pop("quantization_config", None)
    return out
