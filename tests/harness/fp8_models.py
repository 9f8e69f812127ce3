"""A tiny block-fp8 Llama made on the fly, and a "training step" in its own dtypes.

Why: vLLM's CPU build serves block-fp8 checkpoints (`CPUFp8BlockScaledMMKernel`, W8A16 on AMX) the
way DeepSeek-V3 ships them: float8_e4m3fn weights plus a float32 `weight_scale_inv` per 128x128 block,
`quantization_config` {"quant_method": "fp8", "weight_block_size": [128, 128]}. Nothing may be
downloaded, so the suite quantizes a tiny random bf16 Llama here. Every projection's output and
input sizes are multiples of 128 (vLLM checks each fused shard against the block size); embeddings,
norms and lm_head stay bf16, as in DeepSeek's checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.tiny_models import _common, train_tokenizer

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION = {
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# 2 heads of 128 (2 KV groups): every TP=2 shard of q/k/v holds whole 128x128 blocks, as the hook's
# test needs (tests/megatron/fp8_hook_workers.py). Every fp8 module serves this geometry, so all of them
# share one pooled engine (harness/fp8_engine.py `shared_server`); each puts its own weights on it.
HEADS = {"num_attention_heads": 2, "head_dim": 128}


def config(heads: dict | None = None):
    """The tiny fp8 Llama's config: 256 wide, 512-wide MLPs, `heads` (HEADS by default)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_common(), "hidden_size": 256, "intermediate_size": 512, **(heads or HEADS)})


def quantize_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv per block): w ~= q * scale_inv, blockwise, as DeepSeek-V3 stores it."""
    n, k = w.shape
    blocks = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    return q, scale


def llama_bf16(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny Llama's weights in bf16 (random, 0.05 std): what a bf16 trainer holds."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(), dtype=torch.bfloat16)
    with torch.no_grad():
        return {
            name: (torch.randn_like(p) * 0.05 if p.dim() >= 2 else p.detach()).to(torch.bfloat16).contiguous()
            for name, p in model.named_parameters()
        }


def quantized(weights: dict[str, torch.Tensor], quantize=quantize_block_fp8) -> dict[str, torch.Tensor]:
    """The projections quantized by `quantize` (fp8 weight + `weight_scale_inv`), the rest kept bf16."""
    tensors = {}
    for name, value in weights.items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            tensors[name], tensors[name + "_scale_inv"] = quantize(value)
        else:
            tensors[name] = value
    return tensors


def adamw_step(
    opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], gen: torch.Generator, density: float
) -> dict[str, torch.Tensor]:
    """One optimizer step on a sparse random gradient (about `density` of the elements): it moves some bf16
    elements and some blocks' amax. Returns the bf16 weights the trainer then holds."""
    loss = sum(
        (p * torch.randn(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) < density)).sum()
        for p in params.values()
    )
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {n: p.detach().to(torch.bfloat16) for n, p in params.items()}


def write_fp8_llama(out_dir: Path, tensors: dict[str, torch.Tensor], seed: int = 0) -> Path:
    """A servable block-fp8 checkpoint of `tensors`: the weights, config.json and the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    cfg = config()
    cfg.quantization_config = QUANTIZATION
    cfg.save_pretrained(out_dir)
    train_tokenizer(out_dir)
    (out_dir / "tiny_model.json").write_text(json.dumps({"family": "llama_fp8", "seed": seed}))
    return out_dir


def make_fp8_llama(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny block-fp8 Llama checkpoint into `out_dir`."""
    return write_fp8_llama(out_dir, quantized(llama_bf16(seed)), seed)


def step_fp8(q: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """Move about `density` of an fp8 tensor's codes by 1-3 steps of magnitude, never to NaN (0x7f / 0xff)
    nor across the sign: what re-quantizing a slightly trained weight in the same block scale does."""
    bits = q.contiguous().view(torch.uint8).clone().reshape(-1)
    k = max(1, int(bits.numel() * density))
    pos = torch.randperm(bits.numel(), generator=gen)[:k]
    steps = torch.randint(1, 4, (k,), generator=gen) * (torch.randint(0, 2, (k,), generator=gen) * 2 - 1)
    sign, magnitude = bits[pos] & 0x80, (bits[pos] & 0x7F).to(torch.int64)
    bits[pos] = sign | (magnitude + steps).clamp(0, 0x7E).to(torch.uint8)
    return bits.view(FP8).reshape(q.shape)


def step_scales(s: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Change one block's scale of each weight by a few float32 ULPs (a block whose amax moved)."""
    bits = s.contiguous().view(torch.int32).clone().reshape(-1)
    i = int(torch.randint(0, bits.numel(), (1,), generator=gen))
    bits[i] += int(torch.randint(1, 50, (1,), generator=gen))
    return bits.view(torch.float32).reshape(s.shape)


def step_checkpoint(base: Path, out: Path, density: float, seed: int) -> Path:
    """`base` after a "training step" in its own dtypes: fp8 codes, float32 scales and bf16 tensors moved."""
    from harness.perturb import perturb_tensor

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, t in load_file(base / "model.safetensors").items():
        if t.dtype == FP8:
            stepped[name] = step_fp8(t, density, gen)
        elif name.endswith("_scale_inv"):
            stepped[name] = step_scales(t, gen)
        else:
            stepped[name] = perturb_tensor(t, density, gen)
    save_file(stepped, out / "model.safetensors", metadata={"format": "pt"})
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out
