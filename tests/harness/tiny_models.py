"""Tiny HF checkpoints made on the fly: random bf16 weights and a locally trained tokenizer.

Why: every test runs a real vLLM engine and nothing may be downloaded, so the suite builds its
own models. They are small enough for a 2-core CPU but keep the structure that matters for
placement: GQA attention (qkv packing), gated MLPs (gate_up packing), fused MoE experts, GLM4's
shared experts, `e_score_correction_bias` and `first_k_dense_replace`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Delta weight sync ships only the positions and values that changed. "
    "An engine applies them in place, bit for bit, without a full reload. "
    "One two three four five six seven eight nine ten eleven twelve. "
    "Reinforcement learning trainers push new weights after every optimizer step. "
)
VOCAB_SIZE = 512
PROMPTS = ["The quick brown fox", "Delta weight sync ships", "One two three four"]


@dataclass(frozen=True)
class TinyModelSpec:
    """A model family and the transformers config that makes its tiny checkpoint."""

    family: str
    architecture: str
    make_config: Callable[[], object]


def _common() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=256, **_common())


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
        **_common(),
    )


def _glm4_moe():
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
        **_common(),
    )


SPECS: dict[str, TinyModelSpec] = {
    "llama": TinyModelSpec("llama", "LlamaForCausalLM", _llama),
    "qwen3_moe": TinyModelSpec("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe),
    "glm4_moe": TinyModelSpec("glm4_moe", "Glm4MoeForCausalLM", _glm4_moe),
}


def train_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)


def make_tiny_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny HF checkpoint for `family` (random bf16 weights) into `out_dir`."""
    from transformers import AutoModelForCausalLM

    spec = SPECS[family]
    out_dir.mkdir(parents=True, exist_ok=True)
    config = spec.make_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn_like(param) * 0.01)
            elif param.dim() >= 2:
                param.copy_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out_dir)
    train_tokenizer(out_dir)
    (out_dir / "tiny_model.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out_dir
