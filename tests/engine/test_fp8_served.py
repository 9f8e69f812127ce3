"""A block-fp8 checkpoint served as it is, updated by deltas in its own dtypes, bit-exact.

What vLLM 0.32's CPU build does with it (established here on the real engine, `harness/fp8_inspect`):
`Fp8LinearMethod` picks `CPUFp8BlockScaledMMKernel` (W8A16), whose post-load step
- VNNI-packs the float8_e4m3fn weight (`convert_weight_packed`): the same shape, stride and bytes,
  permuted, re-registered as a plain `Parameter` (`replace_parameter`);
- re-registers `weight_scale_inv` as a plain `Parameter` around the same float32 bytes.
So the scales are the checkpoint's bytes (deltas land in place), and the weight is re-laid:
`transforms` re-runs the step ("rerun") from a checkpoint-layout copy that deltas are written into.
Both replaced Parameters lost their loaders; `engine/loaders.py` gives the probe vLLM's recorded
model-format ones (it refused every projection before).

On a CPU without AMX tiles vLLM refuses that kernel (its `is_supported` asks for AMX) and with it
the model. There the engine runs the test-only stand-in of `harness/fp8_kernel.py`: the same class
with the AMX gate replaced by a check that its op computes vLLM's torch reference on this CPU. The
weights, loaders, post-load steps (the VNNI pack included), the matmul itself and our delta apply
are all vLLM's and ours; only the gate differs.

One engine serves the module and tests/megatron/test_hook_fp8.py (an engine start is the suite's largest
cost): the pooled `vllm serve --enable-delta-updates` in dev mode of `fp8_engine.shared_server`. The
module puts it on FINAL with vLLM's `reload_weights` (the whole checkpoint through the model's loaders
and post-load steps, the VNNI pack included); what it serves then is the reference of the first test
(its digests equal a fresh load by vLLM's own loader in another process). Each test then puts the
engine on its own starting weights with vLLM's `reload_weights`, and syncs through our route.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
from harness import fp8_engine, fp8_kernel
from harness.cli_diff import add_digests, diff
from harness.engine_pool import API_KEY, HEADERS, checksums, status
from harness.fp8_inspect import digest, sorted_digest
from harness.fp8_models import (
    adamw_step,
    llama_bf16,
    make_fp8_llama,
    quantized,
    step_checkpoint,
    write_fp8_llama,
)
from harness.fresh_load import save_checkpoint
from harness.vllm_engine import VllmServer, served_greedy
from safetensors.torch import load_file

from vllm_delta import DeltaSender
from vllm_delta.wire import load_manifest

pytestmark = [pytest.mark.heavy, pytest.mark.engine]

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Engine:
    """The module's engine, the chain it was put on the end of, and what it served then."""

    server: VllmServer
    base: Path
    mid: Path
    final: Path
    checksums: dict[str, str]
    outputs: list[tuple[list[str], list[float]]]
    served: dict[str, dict]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, engine_pool):
    root = tmp_path_factory.mktemp("fp8_chain")
    base = make_fp8_llama(root / "base")
    mid = step_checkpoint(base, root / "mid", density=0.03, seed=1)
    final = step_checkpoint(mid, root / "final", density=0.03, seed=2)
    server = fp8_engine.shared_server(engine_pool)  # the pool stops it (test_hook_fp8 may use it next)
    rpc(server, "reload_weights", weights_path=str(final))
    return Engine(
        server,
        base,
        mid,
        final,
        checksums(server.url),
        served_greedy(server.url, HEADERS),
        rpc(server, "fp8_served"),
    )


def rpc(server: VllmServer, method: str, **kwargs) -> object:
    """A worker method through vLLM's dev-mode `/collective_rpc`: rank 0's answer."""
    r = requests.post(
        f"{server.url}/collective_rpc",
        json={"method": method, "kwargs": kwargs},
        headers=HEADERS,
        timeout=600,
    )
    r.raise_for_status()
    return r.json()["results"][0] if r.content else None


def checkpoint_tensor(ckpt: dict[str, torch.Tensor], module: str, suffix: str) -> torch.Tensor:
    """A served module's tensor in the checkpoint, fused as vLLM fuses qkv and gate_up (dim 0)."""
    prefix, _, leaf = module.rpartition(".")
    return torch.cat([ckpt[f"{prefix}.{p}.{suffix}"] for p in FUSED.get(leaf, (leaf,))])


def test_block_fp8_engine_takes_fp8_and_scale_deltas_bit_exact(engine, engine_pool, fresh_loader):
    """BASE reloaded, then a base-relative delta and an overwrite delta that change fp8 codes and block
    scales, through our route: the engine ends on FINAL exactly, as it served after a full load of FINAL."""
    server = engine.server
    rpc(server, "reload_weights", weights_path=str(engine.base))
    base_sums = checksums(server.url)
    v0 = status(server.url)["version"]
    root = engine_pool.delta_root()
    tag = uuid.uuid4().hex[:8]
    chain = [
        diff(engine.base, engine.mid, root / f"fp8-{tag}-1", "ulp_zstd", v0 + 1, v0),
        diff(engine.mid, engine.final, root / f"fp8-{tag}-2", "deltas_zstd", v0 + 2, v0 + 1),
    ]
    replies = []
    for version, path in enumerate(chain, start=v0 + 1):
        r = requests.post(
            f"{server.url}/update_weights_delta",
            json={"path": path.name, "version": version},
            headers=HEADERS,
            timeout=300,
        )
        replies.append((r.status_code, r.json()))
    applied, applied_out = checksums(server.url), served_greedy(server.url, HEADERS)
    served, placement = rpc(server, "fp8_served"), status(server.url)["placement"]
    # BASE's delta again, stating BASE's digests (as a sender does), now on FINAL: refused by them.
    stale = diff(engine.base, engine.mid, root / f"fp8-{tag}-3", "ulp_zstd", v0 + 3, v0 + 2)
    add_digests(stale, engine.base, engine.mid)
    r = requests.post(
        f"{server.url}/update_weights_delta",
        json={"path": stale.name, "version": v0 + 3},
        headers=HEADERS,
        timeout=300,
    )
    refused = (r.status_code, r.json(), checksums(server.url), rpc(server, "fp8_served"))

    # What the CPU fp8 kernel's post-load step did to FINAL, against the checkpoint's bytes.
    ckpt = load_file(engine.final / "model.safetensors")
    assert len(engine.served) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for module, s in engine.served.items():
        assert s["kernel"] == fp8_kernel.served_kernel(), (module, s["kernel"])
        # replace_parameter: both plain Parameters; only the weight is re-laid, so only it is re-run
        assert (s["weight_class"], s["scale_class"], s["kind"], s["changed"]) == (
            "Parameter", "Parameter", "rerun", ["weight"]
        ), module  # fmt: skip
        weight, scale = (
            checkpoint_tensor(ckpt, module, "weight"),
            checkpoint_tensor(ckpt, module, "weight_scale_inv"),
        )
        assert s["live_scale"] == digest(scale), module  # the scales are served as the checkpoint's bytes
        assert s["canonical_weight"] == digest(weight), module  # deltas go to the checkpoint-layout copy
        assert s["live_weight"] != digest(weight), module  # the live weight is re-laid (VNNI) ...
        assert s["live_weight_sorted"] == sorted_digest(weight), module  # ... from the same bytes
    # The probe maps every tensor with the model's loaders: nothing falls back, nothing is refused.
    assert placement["ready"] and placement["fallback"] == [] and placement["refused"] == {}, placement
    # Each fp8 linear's post-load step (its VNNI pack) ran in prepare on a stand-in, none in the pause.
    assert not set(engine.served) & set(placement["in_pause"]), placement["in_pause"]
    # The chain changed fp8 codes and scales, applied through the map, and ends on FINAL exactly: the
    # digests, the tokens and logprobs, and every layer's live and checkpoint-layout bytes.
    assert engine.checksums == fresh_loader.checksums(engine.final) and base_sums != engine.checksums
    for path, (code, reply) in zip(chain, replies):
        assert code == 200 and reply["fallback"] == [], reply
        changed = {
            p.dtype for p in load_manifest(path).params if p.changed
        }  # every fp8 weight and scale moved
        assert {"float8_e4m3fn", "float32"} <= changed, changed
    assert [n for n in engine.checksums if applied[n] != engine.checksums[n]] == []
    assert applied_out == engine.outputs
    assert served == engine.served
    # Refused before any write (re-packs are built in prepare): no weight, scale, checkpoint-layout copy
    # or pointer moved.
    code, reply, after_sums, after_served = refused
    assert code == 400 and reply["error"]["type"] == "IntegrityError", reply
    assert after_sums == applied and after_served == served


def reference_export(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference quantizer's export of bf16 weights: vLLM's `per_block_cast_to_fp8` (imported)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return quantized(weights, lambda w: per_block_cast_to_fp8(w, [128, 128]))


def test_bf16_adamw_trainer_syncs_block_fp8_engine(engine, engine_pool, fresh_loader, tmp_path):
    """Issue 32: a bf16 AdamW trainer's `DeltaSender`, seeded from the served block-fp8 checkpoint,
    quantizes as the reference does. After each sync the engine's digests equal a fresh load (vLLM's
    loader, another process) of the reference's export of the trainer's weights, and its tokens and
    logprobs equal its own after vLLM's `reload_weights` of that export. The digests cover every live
    tensor the matmuls read (the VNNI-packed weights, the scales), so the reload adds the outputs'
    check, not a second weight check; a separate reference engine would cost another start."""
    start = llama_bf16(seed=0)
    trainer = {n: torch.nn.Parameter(w.float()) for n, w in start.items()}
    base = write_fp8_llama(tmp_path / "base", reference_export(start))
    server = engine.server
    rpc(server, "reload_weights", weights_path=str(base))
    sender = DeltaSender(
        [server.url], "disk", engine_pool.delta_root(), api_key=API_KEY, version=status(server.url)["version"]
    )
    try:
        sender.seed_from_checkpoint(base)
        opt = torch.optim.AdamW(trainer.values(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            weights = adamw_step(opt, trainer, gen, density=0.02)
            m = sender.sync(weights)
            assert m["sender/all_acked"] == 1.0 and m["sender/changed_elements"] > 0, (step, sender.engines)
            export = save_checkpoint(reference_export(weights), base, tmp_path / f"export{step}")
            assert checksums(server.url) == fresh_loader.checksums(export), step
            synced = served_greedy(server.url, HEADERS)
            rpc(server, "reload_weights", weights_path=str(export))
            assert served_greedy(server.url, HEADERS) == synced, step
    finally:
        sender.close()
