"""End to end: megatron-core at TP=2 x EP=2 (4 gloo ranks, tiny Qwen3-MoE through mbridge) with the
hook pushing disk deltas to a real `vllm serve --enable-delta-updates` for 3 steps. A fresh engine
loaded from mbridge's own export of the final trainer weights must report the same
`/weight_checker` digests and the same greedy completion as the synced engine. The synced engine
takes only manifests signed with its key: the hook's sender signs each one; a delta of the final
weights that is unsigned, or signed with another key, is then refused (403) and changes nothing.

The fresh engine is started beside the synced one, on the same base checkpoint, and takes no
update: once the export exists, vLLM's own `reload_weights` loads it (the whole checkpoint, through
the model's loaders and post-load steps), before it serves any request. Its start overlaps the
other's instead of following the training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests
import torch
from harness import megatron_cpu
from harness.vllm_engine import VllmServer, start_servers
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
    """Greedy completion through the OpenAI route (the key is required there too)."""
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
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


def test_tp2_ep2_hook_matches_a_fresh_engine_on_the_export(tiny_model_factory, tmp_path):
    hf = tiny_model_factory("qwen3_moe")
    roots = [Path(os.path.realpath(tmp_path / name)) for name in ("root", "fresh_root")]
    for root in roots:
        root.mkdir()
    final = tmp_path / "final"
    server, fresh = start_servers(
        lambda: _serve(hf, roots[0], tmp_path / "serve.log", signed=True),
        lambda: _serve(hf, roots[1], tmp_path / "fresh.log"),
    )
    with server, fresh:
        initial = _checksums(server)
        version = _status(server)["version"]
        megatron_cpu.spawn(
            engine_worker,
            4,
            str(hf),
            server.url,
            str(roots[0]),
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
        assert _checksums(fresh) == initial  # nothing reached the fresh engine
        _reload(fresh, final)
        assert _checksums(fresh) == synced
        assert _greedy(fresh) == _greedy(server)
        _forged_deltas_are_refused(server, roots[0], final, version + STEPS)


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
