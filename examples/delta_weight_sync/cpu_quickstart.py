#!/usr/bin/env python3
"""CPU quick start: a real `vllm serve --enable-delta-updates` takes three training steps as deltas.

It builds a tiny random Llama, starts the engine exactly as a user would, then for each step:
perturbs the weights like an Adam step, writes the delta with `vllm-delta diff`, and pushes it
to `POST /update_weights_delta`. The engine checks every tensor it holds whole against the
sender's post-apply hash, so a 200 means bit-exact. The last line printed is one JSON summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builder and server harness live with the tests

from harness.perturb import perturb_checkpoint  # noqa: E402
from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402

STEPS = 3
VLLM_DELTA = str(Path(sys.executable).parent / "vllm-delta")


def main() -> int:
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-delta-demo-"))
    base = make_tiny_model("llama", work / "model_v0")
    root = work / "deltas"
    root.mkdir()
    steps = []
    with VllmServer(base, work / "serve.log",
                    extra_args=["--enable-delta-updates", "--delta-updates-root", str(root)]) as server:
        current = base
        for version in range(1, STEPS + 1):
            new = perturb_checkpoint(current, work / f"model_v{version}", density=0.02, seed=version)
            out = root / f"weight_v{version:06d}"
            subprocess.run([VLLM_DELTA, "diff", str(current), str(new), str(out), "--encoding", "ulp_zstd",
                            "--version", str(version), "--base-version", str(version - 1)],
                           check=True, capture_output=True)
            resp = requests.post(f"{server.url}/update_weights_delta",
                                 json={"path": out.name, "version": version, "base_version": version - 1},
                                 timeout=300)
            resp.raise_for_status()
            body = resp.json()
            disk = sum(p.stat().st_size for p in out.iterdir())
            steps.append({"version": version, "changed": body["changed"], "delta_bytes": disk,
                          "bytes_per_changed": round(disk / max(body["changed"], 1), 3),
                          "apply_s": round(body["apply_s"], 4), "pause_s": round(body["pause_s"], 4)})
            print(f"step {version}: {steps[-1]}", flush=True)
            current = new
        status = requests.get(f"{server.url}/delta_updates/status", timeout=30).json()
        completion = server.complete("The quick brown fox", max_tokens=8)
    full_bytes = sum(p.stat().st_size for p in current.glob("*.safetensors"))
    summary = {
        "demo": "cpu_quickstart", "model": "tiny-llama (random bf16)", "engine_version": status["version"],
        "healthy": status["healthy"], "syncs": len(steps),
        "delta_bytes_total": sum(s["delta_bytes"] for s in steps), "full_checkpoint_bytes": full_bytes,
        "max_pause_s": max(s["pause_s"] for s in steps), "served_text": completion["text"],
        "steps": steps, "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0 if status["healthy"] and status["version"] == STEPS else 1


if __name__ == "__main__":
    sys.exit(main())
