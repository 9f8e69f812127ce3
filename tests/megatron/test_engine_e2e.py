"""End to end: megatron-core at TP=2 x EP=2 (4 gloo ranks, tiny Qwen3-MoE through mbridge) with the
hook pushing disk deltas to a real `vllm serve --enable-delta-updates` for 3 steps. vLLM's own load of
mbridge's export of the final trainer weights must give the same `/weight_checker` digests and the same
greedy completion as the synced engine. The synced engine takes only manifests signed with its key: the
hook's sender signs each one; a delta of the final weights that is unsigned, or signed with another key,
is then refused (403) and changes nothing.

vLLM's load of the export is its `reload_weights` (the whole checkpoint, through the model's loaders and
post-load steps, as a fresh engine on the base would load it) into the synced engine once the checks
above are done: every parameter `/weight_checker` digests, derived ones included, is written again by
code other than ours, so the digests after it equal the synced ones only if the sync wrote what vLLM
writes, and the completion (cache-salted: nothing read from a prefix cached before the reload) is that
of vLLM-loaded weights. A second TP=2 engine for it cost a start (4 processes importing vLLM).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import requests
import torch
from harness import megatron_cpu
from harness.vllm_engine import VllmServer
from hook_workers import engine_worker

pytestmark = [pytest.mark.megatron, pytest.mark.engine, pytest.mark.heavy]
API_KEY = "megatron-e2e-key"
SIGNING_KEY = "megatron-e2e-signing-key-0123456789"
STEPS = 3
ENGINE_TP = 2


def _hdr() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _checksums(server: VllmServer) -> dict[str, str]:
    r = requests.post(
        f"{server.url}/weight_checker", json={"action": "checksum"}, headers=_hdr(), timeout=120
    )
    r.raise_for_status()
    return r.json()["checksums"]


def _status(server: VllmServer) -> dict:
    r = requests.get(f"{server.url}/delta_updates/status", headers=_hdr(), timeout=60)
    r.raise_for_status()
    return r.json()


def _greedy(server: VllmServer) -> str:
    """Greedy completion through the OpenAI route (the key is required there too), cache-salted."""
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
        "cache_salt": uuid.uuid4().hex,
    }
    r = requests.post(f"{server.url}/v1/completions", json=body, headers=_hdr(), timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _serve(model: Path, root: Path, log: Path, signed: bool = False) -> VllmServer:
    args = ["--enable-delta-updates", "--delta-updates-root", str(root), "--api-key", API_KEY]
    args += ["--delta-updates-signing-key", SIGNING_KEY] if signed else []
    return VllmServer(model, log, tp=ENGINE_TP, extra_args=args)


def _reload(server: VllmServer, model_dir: Path) -> None:
    """vLLM's in-place full load of `model_dir`'s checkpoint (the dev-mode `/collective_rpc` route)."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
    r = requests.post(f"{server.url}/collective_rpc", json=body, headers=_hdr(), timeout=300)
    r.raise_for_status()


def test_tp2_ep2_hook_matches_vllms_load_of_the_export(tiny_model_factory, tmp_path):
    hf = tiny_model_factory("qwen3_moe")
    root = Path(os.path.realpath(tmp_path / "root"))
    root.mkdir()
    final = tmp_path / "final"
    with _serve(hf, root, tmp_path / "serve.log", signed=True) as server:
        initial = _checksums(server)
        version = _status(server)["version"]
        megatron_cpu.spawn(
            engine_worker,
            4,
            str(hf),
            server.url,
            str(root),
            API_KEY,
            SIGNING_KEY,
            version,
            STEPS,
            str(final),
            timeout=900,
        )
        s = _status(server)
        assert s["version"] == version + STEPS and s["healthy"], s
        synced = _checksums(server)
        assert synced != initial
        synced_text = _greedy(server)
        _forged_deltas_are_refused(server, root, final, version + STEPS)
        _reload(server, final)
        assert _checksums(server) == synced
        assert _greedy(server) == synced_text


def _forged_deltas_are_refused(server: VllmServer, root: Path, final: Path, version: int) -> None:
    """A valid next delta from the final weights, written to the root by someone without the key."""
    from safetensors.torch import load_file

    from vllm_delta.diff import diff_param
    from vllm_delta.wire import DeltaWriter, load_manifest, write_manifest
    from vllm_delta.wire.signing import sign

    weights = load_file(final / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("down_proj.weight"))
    new = weights[name].clone()
    new.view(-1).view(torch.int16)[::7] += 1
    before = _checksums(server)
    for label, keys in (("unsigned", []), ("other-key", [b"someone-elses-key-0123456789"])):
        path = root / f"forged-{label}"
        with DeltaWriter(path, version=version + 1, base_version=version) as writer:
            d = diff_param(new, weights[name])
            writer.add(name, d.positions, d.new_values, d.old_values, shape=new.shape)
        if keys:
            write_manifest(path, sign(load_manifest(path), keys))
        r = requests.post(
            f"{server.url}/update_weights_delta",
            json={"path": path.name, "version": version + 1, "base_version": version},
            headers=_hdr(),
            timeout=120,
        )
        assert r.status_code == 403 and r.json()["error"]["type"] == "SignatureError", r.text
        assert _checksums(server) == before and _status(server)["version"] == version
