"""Block-fp8 served checkpoints for the hook's tests, and the TP=2 worker that syncs one.

Two tiny Llamas, both 256 wide with 512-wide MLPs and 128x128 blocks: `ALIGNED` (2 heads of 128, 2 KV
groups) gives every TP=2 shard whole blocks; `STRADDLING` (4 heads of 64, 2 KV groups) gives each rank
64 of k_proj's 128 rows, half a block. The served checkpoint is the reference quantizer's export of the
trainer's bf16 weights: vLLM's own `per_block_cast_to_fp8`, imported in the test process only.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from harness import megatron_cpu
from harness.engine_pool import checksums
from harness.fp8_models import HEADS, config
from harness.tiny_models import train_tokenizer
from harness.vllm_engine import served_greedy
from hook_workers import LR, tokens
from safetensors.torch import load_file, save_file

BLOCK = [128, 128]
QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": BLOCK,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALIGNED = HEADS  # the geometry every fp8 engine module serves: they share one engine (harness/fp8_engine)
STRADDLING = {"num_attention_heads": 4, "head_dim": 64}


def quantized(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def reference_export(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference quantizer's export of bf16 HF weights: what a fresh block-fp8 engine loads."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out = {}
    for name, w in weights.items():
        if quantized(name):
            out[name], out[name + "_scale_inv"] = per_block_cast_to_fp8(w, BLOCK)
        else:
            out[name] = w.clone()
    return out


def write_pair(root: Path, heads: dict, tokenizer: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(the trainer's bf16 checkpoint, the served block-fp8 one: the reference's export of it, with a
    tokenizer if an engine will serve it)."""
    from transformers import AutoModelForCausalLM

    cfg = config(heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        weights = {
            n: (torch.randn_like(p) * 0.05 if p.dim() >= 2 else p.detach()).to(torch.bfloat16).contiguous()
            for n, p in model.named_parameters()
        }
    dirs = root / "bf16", root / "fp8"
    for path, tensors in zip(dirs, (weights, reference_export(weights))):
        path.mkdir(parents=True)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        cfg.quantization_config = QUANTIZATION if path.name == "fp8" else None
        data = cfg.to_dict()
        if data.get("quantization_config") is None:
            data.pop("quantization_config", None)
        (path / "config.json").write_text(json.dumps(data))
    if tokenizer:
        train_tokenizer(dirs[1])
    return dirs


def fp8_worker(
    rank,
    world,
    port,
    straddling: tuple[str, str],
    aligned: tuple[str, str],
    engine: dict,
    steps: int,
    out: str,
):
    """At TP=2: registering on the straddling checkpoint is refused on every rank, naming k_proj and the rows
    this rank holds. On the aligned one, `steps` real steps each push the changed codes and scales (and bf16
    tensors) of every rank's shard to the engine (`engine`: url, root, api_key, version). After each, rank 0
    writes the shipped entries, mbridge's export and what the engine serves (digests, greedy outputs)."""
    import pytest

    from megatron_hook import register
    from vllm_delta import DeltaSender
    from vllm_delta.sender.fp8_quant import Fp8ConfigError

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port, tp=2)
    group = dist.new_group(backend="gloo")
    with tempfile.TemporaryDirectory() as root:
        model, opt, _, bridge = megatron_cpu.build_from_hf(straddling[0], lr=LR)
        sender = DeltaSender([], "disk", root, group=group)
        held = rf"rows \[{64 * rank}, {64 * (rank + 1)}\) x columns \[0, 256\)"
        with pytest.raises(
            Fp8ConfigError, match=rf"model\.layers\.0\.self_attn\.k_proj\.weight: .*{held}.*TP {rank} of 2"
        ):
            register(opt, [model], sender, bridge=bridge, checkpoint=straddling[1])
        assert "step" not in vars(opt), "a refused register() must leave the optimizer alone"
        sender.close()

    model, opt, gpt, bridge = megatron_cpu.build_from_hf(aligned[0], lr=LR)
    url, key = engine["url"], engine["api_key"]
    sender = DeltaSender([url], "disk", engine["root"], api_key=key, group=group, version=engine["version"])
    synced: list[dict] = []
    handle = register(opt, [model], sender, bridge=bridge, checkpoint=aligned[1], on_sync=synced.append)
    assert handle.seed_report.ok, handle.seed_report  # the trainer, quantized here, is the served export
    for step in range(steps):
        megatron_cpu.train_step(model, opt, tokens(step))
        handle.flush()
        assert synced[-1]["sender/all_acked"] == 1.0, synced[-1]
        mine = [(e.name, e.positions, _bits(e.new_values)) for e in handle.last_capture.entries]
        every = [None] * world
        dist.all_gather_object(every, mine)
        export = megatron_cpu.export_hf(bridge, gpt)  # mbridge's gather of the bf16 weights, not our map
        if rank == 0:
            headers = {"Authorization": f"Bearer {key}"}
            torch.save(
                {
                    "entries": [e for part in every for e in part],
                    "export": export,
                    "checksums": checksums(url, key),
                    "outputs": served_greedy(url, headers),
                },
                f"{out}/{step}.pt",
            )
    handle.remove()
    sender.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(path) / "model.safetensors")
