"""A block-fp8 checkpoint served as it is, updated by deltas in its own dtypes, bit-exact.

What vLLM 0.32's CPU build does with it (established here on the real engine, `harness/fp8_inspect`):
`Fp8LinearMethod` picks `CPUFp8BlockScaledMMKernel` (W8A16 on AMX), whose post-load step
- VNNI-packs the float8_e4m3fn weight (`convert_weight_packed`): the same shape, stride and bytes,
  permuted, re-registered as a plain `Parameter` (`replace_parameter`);
- re-registers `weight_scale_inv` as a plain `Parameter` around the same float32 bytes.
So the scales are the checkpoint's bytes (deltas land in place), and the weight is re-laid:
`transforms` re-runs the step ("rerun") from a checkpoint-layout copy that deltas are written into.
Both replaced Parameters lost their loaders; `engine/loaders.py` gives the probe vLLM's recorded
model-format ones (it refused every projection before).

The engine starts on FINAL (the reference: its fresh load's digests, equal to vLLM's own load in
another process, and greedy tokens and logprobs), reloads BASE with vLLM's `reload_weights`, then
takes a base-relative delta and an overwrite delta that change fp8 codes and block scales.
"""

from __future__ import annotations

import pytest
import requests
import torch
from harness.cli_diff import diff
from harness.engine_pool import API_KEY
from harness.fp8_inspect import served_fp8
from harness.fp8_models import llama_bf16, make_fp8_llama, quantized, step_checkpoint, write_fp8_llama
from harness.fresh_load import save_checkpoint
from harness.tiny_models import PROMPTS
from harness.vllm_engine import VllmServer, greedy, start_llm
from safetensors.torch import load_file

from vllm_delta import DeltaSender
from vllm_delta.wire import load_manifest

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.engine,
    pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="vLLM 0.32's CPU block-fp8 kernels (CPUFp8BlockScaledMMKernel, "
        "CPUFp8W8A8BlockScaledMMKernel) need AMX tiles; this CPU's vLLM refuses the model",
    ),
]

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_bytes(ckpt: dict[str, torch.Tensor], module: str, suffix: str) -> bytes:
    """The checkpoint's bytes of a served module's tensor, fused as vLLM fuses qkv and gate_up (dim 0)."""
    prefix, _, leaf = module.rpartition(".")
    parts = [f"{prefix}.{p}.{suffix}" for p in FUSED.get(leaf, (leaf,))]
    return torch.cat([ckpt[p] for p in parts]).contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def outputs(llm) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and logprobs, one prompt per call: vLLM's CPU fp8 kernel rounds by batch shape, and the
    three prompts are not batched alike in every call (a stock engine with unchanged weights moved prompt 0's
    first logprob -4.488667 -> -4.487775 between calls, KV caches zeroed or not); alone, each is the same."""
    return [greedy(llm, [p])[0] for p in PROMPTS]


def test_block_fp8_engine_takes_fp8_and_scale_deltas_bit_exact(tmp_path, fresh_loader):
    base = make_fp8_llama(tmp_path / "base")
    mid = step_checkpoint(base, tmp_path / "mid", density=0.03, seed=1)
    final = step_checkpoint(mid, tmp_path / "final", density=0.03, seed=2)
    chain = [
        diff(base, mid, tmp_path / "d1", "ulp_zstd", 1, 0),
        diff(mid, final, tmp_path / "d2", "deltas_zstd", 2, 1),
    ]
    with start_llm(final, delta=True) as llm:
        reference, reference_out = llm.collective_rpc("compute_weight_checksums")[0], outputs(llm)
        (served,) = llm.collective_rpc(served_fp8)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(base)})
        base_sums = llm.collective_rpc("compute_weight_checksums")[0]
        (probe,) = llm.collective_rpc("delta_probe")
        (coverage,) = llm.collective_rpc("delta_coverage")
        llm.collective_rpc("delta_set_peers", args=([coverage],))
        replies = []
        for version, path in enumerate(chain, start=1):
            request = {
                "id": f"v{version}",
                "path": str(path),
                "version": version,
                "base_version": version - 1,
                "files": None,
                "max_staged_bytes": 1 << 20,
            }
            (prepared,) = llm.collective_rpc("delta_prepare", args=(request,))
            (committed,) = (
                llm.collective_rpc("delta_commit", args=(request["id"],)) if prepared["ok"] else (None,)
            )
            replies.append((prepared, committed))
        applied, applied_out = llm.collective_rpc("compute_weight_checksums")[0], outputs(llm)
    fresh = fresh_loader.checksums(final)

    # What the CPU fp8 kernel's post-load step did, against the checkpoint's bytes.
    ckpt = load_file(final / "model.safetensors")
    assert len(served) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for module, s in served.items():
        assert s["kernel"] == "CPUFp8BlockScaledMMKernel", (module, s["kernel"])
        assert (s["weight_class"], s["scale_class"]) == ("Parameter", "Parameter"), (
            module
        )  # replace_parameter
        assert (s["kind"], s["changed"]) == ("rerun", ["weight"]), module
        weight, scale = (
            checkpoint_bytes(ckpt, module, "weight"),
            checkpoint_bytes(ckpt, module, "weight_scale_inv"),
        )
        assert s["live_scale"] == scale, module  # the scales are served as the checkpoint's bytes
        assert s["canonical_weight"] == weight, module  # deltas go to the checkpoint-layout copy
        assert s["live_weight"] != weight and sorted(s["live_weight"]) == sorted(weight), (
            module
        )  # re-laid bytes
    # The probe maps every tensor with the model's loaders: nothing falls back, nothing is refused.
    assert probe["ready"] and probe["fallback"] == {} and probe["refused"] == {}, probe
    assert coverage["map_errors"] == {} and coverage["fallback"] == [], coverage
    # The chain changed fp8 codes and scales, applied through the map, and ends on FINAL exactly.
    assert reference == fresh and base_sums != reference
    for path, (prepared, committed) in zip(chain, replies):
        assert prepared["ok"] and prepared["fallback"] == [] and committed["ok"], (prepared, committed)
        changed = {
            p.dtype for p in load_manifest(path).params if p.changed
        }  # every fp8 weight and scale moved
        assert {"float8_e4m3fn", "float32"} <= changed, changed
    assert [n for n in reference if applied[n] != reference[n]] == []
    assert applied_out == reference_out


def reference_export(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference quantizer's export of bf16 weights: vLLM's `per_block_cast_to_fp8` (imported)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return quantized(weights, lambda w: per_block_cast_to_fp8(w, [128, 128]))


def served_outputs(url: str, headers: dict[str, str]) -> list[tuple[list[str], list[float]]]:
    """Greedy tokens and logprobs over HTTP, one prompt per request (see `outputs`)."""
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "seed": 0}
        r = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def test_bf16_adamw_trainer_syncs_block_fp8_engine(tmp_path, engine_pool, fresh_loader):
    """Issue 32: a bf16 AdamW trainer's `DeltaSender`, seeded from the served block-fp8 checkpoint,
    quantizes as the reference does; after each sync the engine's digests equal a fresh load of the
    reference's export of the trainer's weights, and its tokens and logprobs equal an engine that
    reloads that export with vLLM's own loader."""
    trainer = {n: torch.nn.Parameter(w.float()) for n, w in llama_bf16(seed=0).items()}
    bf16 = lambda: {n: p.detach().to(torch.bfloat16) for n, p in trainer.items()}  # noqa: E731
    base = write_fp8_llama(tmp_path / "base", reference_export(bf16()))
    server = engine_pool.delta_engine(base)
    reference = VllmServer(base, tmp_path / "reference.log")  # dev mode: reloads through /collective_rpc
    sender = DeltaSender([server.url], "disk", engine_pool.delta_root(), api_key=API_KEY, version=0)
    key = {"Authorization": f"Bearer {API_KEY}"}
    try:
        sender.seed_from_checkpoint(base)
        opt = torch.optim.AdamW(trainer.values(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            loss = sum(
                (p * torch.randn(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) < 0.02)).sum()
                for p in trainer.values()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            m = sender.sync(bf16())
            assert m["sender/all_acked"] == 1.0 and m["sender/changed_elements"] > 0, (step, sender.engines)
            export = save_checkpoint(reference_export(bf16()), base, tmp_path / f"export{step}")
            synced = requests.post(
                f"{server.url}/weight_checker", json={"action": "checksum"}, headers=key, timeout=120
            )
            assert synced.json()["checksums"] == fresh_loader.checksums(export), step
            r = requests.post(
                f"{reference.url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(export)}},
                timeout=600,
            )
            r.raise_for_status()
            assert served_outputs(server.url, key) == served_outputs(reference.url, {}), step
    finally:
        sender.close()
        reference.stop()
        server.stop()  # an fp8 engine no other module shares
