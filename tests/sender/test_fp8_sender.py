"""A bf16 trainer feeding block-fp8 engines: the sender's quantizer against the reference itself.

The reference is vLLM's `vllm.utils.deep_gemm.per_block_cast_to_fp8` (DeepGEMM's block cast, vLLM's own
online block-fp8 quantizer), imported, never our function. The sender is seeded from a block-fp8
checkpoint, the trainer takes real AdamW steps in bf16, and after each sync a real-HTTP engine applying the
wire's own decoding holds exactly the reference's export of the trainer's weights: fp8 codes, float32
`weight_scale_inv`, and the unquantized tensors in bf16. Only blocks holding a changed bf16 element are
re-quantized, and only changed codes and scales are shipped. Configs the sender does not produce are
refused at `seed_from_checkpoint`, naming the tensor, before anything is seeded.
"""

from __future__ import annotations

import json

import pytest
import torch
from harness.fp8_models import adamw_step
from safetensors.torch import save_file
from sender_helpers import FakeEngine

from vllm_delta import DeltaSender
from vllm_delta.sender.fp8_quant import BlockFp8Quantizer, BlockFp8Spec, Fp8ConfigError
from vllm_delta.sender.shards import Shard
from vllm_delta.wire import MANIFEST_NAME, parse_manifest

QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# Whole blocks, edge blocks on both dims (DeepSeek's kv_a_proj_with_mqa is 576 rows), and a small tensor.
SHAPES = {"a.q_proj.weight": (256, 384), "a.kv_a_proj.weight": (200, 300), "a.o_proj.weight": (64, 96)}
PLAIN = {"a.norm.weight": (384,), "embed.weight": (40, 384)}


def reference(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(w, list(block))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def exported(weights: dict[str, torch.Tensor], block=(128, 128)) -> dict[str, torch.Tensor]:
    """The reference's export of bf16 weights: what a fresh fp8 engine would load."""
    out = {}
    for name, w in weights.items():
        if name in SHAPES:
            out[name], out[name + "_scale_inv"] = reference(w, block)
        else:
            out[name] = w.clone()
    return out


def bf16_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {**SHAPES, **PLAIN}
    w = {n: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
    w["a.o_proj.weight"][:, :32] = 0  # an all-zero block column: the reference's amax floor
    return w


def write_checkpoint(path, tensors: dict[str, torch.Tensor], quant: dict | None = QUANT):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"quantization_config": quant} if quant else {}))
    return path


@pytest.mark.parametrize("block", [(128, 128), (64, 128)])
def test_quantizer_equals_the_reference_per_changed_block(block):
    """Full and incremental quantization equal the reference's full quantization, bit for bit; only the
    blocks holding a changed bf16 element are re-quantized."""
    weights = bf16_weights(1)
    quantizer = BlockFp8Quantizer(BlockFp8Spec(block, ()), list(SHAPES))
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        if step:  # a sparse step: some elements move, most blocks keep every bf16 element
            w = weights["a.q_proj.weight"].view(-1)
            pos = torch.randint(0, w.numel(), (5,), generator=gen)
            w[pos] = (w[pos].float() * 1.5 + 0.01).to(torch.bfloat16)
            weights["a.kv_a_proj.weight"][199, 299] = 0.75  # the edge block's new extreme moves its scale
        before = quantizer.blocks_requantized
        out = {s.name: s.tensor for s in quantizer.apply([Shard.whole(n, w) for n, w in weights.items()])}
        want = exported(weights, block)
        assert out.keys() == want.keys()
        assert all(torch.equal(bits(out[k]), bits(want[k])) for k in want), step
        if step:
            assert quantizer.blocks_requantized - before <= 6  # 5 positions in q_proj + one edge block


def test_bf16_adamw_trainer_syncs_block_fp8_engine_bit_exact(tmp_path):
    """Seeded from a block-fp8 checkpoint, synced from real AdamW steps in bf16: after every sync the
    engine holds the reference's export of the trainer's weights, and only changed codes and scales ship."""
    served = exported(bf16_weights(0))
    ckpt = write_checkpoint(tmp_path / "ckpt", served)
    engine = FakeEngine(tmp_path / "deltas", served)
    sender = DeltaSender([engine.url], "disk", tmp_path / "deltas", retries=0, keep=True)
    try:
        sender.seed_from_checkpoint(ckpt)
        params = {n: torch.nn.Parameter(w.float()) for n, w in bf16_weights(3).items()}
        opt = torch.optim.AdamW(params.values(), lr=1e-3)
        gen = torch.Generator().manual_seed(4)
        previous, shipped_by_step = served, []
        for step in range(1, 5):
            trainer = adamw_step(opt, params, gen, density=0.1)
            sender.sync(trainer)
            want = exported(trainer)
            assert all(torch.equal(bits(engine.weights[k]), bits(want[k])) for k in want), step
            manifest = parse_manifest((tmp_path / "deltas" / f"v{step:06d}" / MANIFEST_NAME).read_bytes())
            shipped = {p.name: p.changed for p in manifest.params if p.changed}
            moved = {k: int((bits(want[k]) != bits(previous[k])).sum()) for k in want}
            assert shipped == {k: n for k, n in moved.items() if n}, step
            previous = want
            shipped_by_step.append(shipped)
        # The first sync re-quantizes the trainer's own weights; later AdamW steps move codes and scales too.
        later = {k for shipped in shipped_by_step[1:] for k in shipped}
        assert {"a.q_proj.weight", "a.q_proj.weight_scale_inv"} <= set(shipped_by_step[0])
        assert "a.q_proj.weight" in later and any(k.endswith("_scale_inv") for k in later), later
    finally:
        sender.close()
        engine.close()


def refused(tmp_path, tensors, quant=QUANT, **kw) -> str:
    ckpt = write_checkpoint(tmp_path / "bad", tensors, quant)
    sender = DeltaSender([], "disk", tmp_path / "d")
    try:
        with pytest.raises(Fp8ConfigError) as err:
            sender.seed_from_checkpoint(ckpt, **kw)
        assert sender.producer.names == [] and sender.fp8 is None  # nothing seeded
        return str(err.value)
    finally:
        sender.close()


@pytest.mark.parametrize(
    "change, why",
    [
        ({"scale_fmt": "ue8m0"}, "not 'ue8m0'"),
        ({"fmt": "e5m2"}, "float8_e4m3fn codes only"),
        ({"activation_scheme": "static"}, "static activation scales"),
        ({"weight_block_size": None}, "per-tensor / channel-wise fp8 is not delta-synced"),
        ({"quant_method": "compressed-tensors"}, "only block fp8"),
    ],
)
def test_configs_the_sender_does_not_produce_are_refused(tmp_path, change, why):
    quant = {k: v for k, v in {**QUANT, **change}.items() if v is not None}
    msg = refused(tmp_path, exported(bf16_weights(0)), quant)
    assert why in msg and msg.split(":")[0] in SHAPES, msg  # names a quantized tensor


def test_tensors_the_sender_does_not_produce_are_refused(tmp_path):
    served = exported(bf16_weights(0))
    msg = refused(tmp_path, {**served, "a.q_proj.weight_scale_inv": served["a.q_proj.weight_scale_inv"][:1]})
    assert msg.startswith("a.q_proj.weight: fp8") and "[2, 3]" in msg, msg
    msg = refused(tmp_path, {**served, "a.up_proj.weight": served["embed.weight"].to(torch.float8_e5m2)})
    assert msg.startswith("a.up_proj.weight: float8_e5m2"), msg
    msg = refused(tmp_path, {**served, "a.gate.weight_scale": torch.ones(())})
    assert msg.startswith("a.gate.weight_scale: a per-tensor scale"), msg
    msg = refused(tmp_path, served, {**QUANT, "ignored_layers": ["a.q_proj"]})
    assert "leaves a.q_proj unquantized" in msg, msg
