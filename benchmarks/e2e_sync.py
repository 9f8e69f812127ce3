"""What a user's sync costs end to end on a tensor-count-true engine, phase by phase (issue 30).

A real `vllm serve --enable-delta-updates` on a production model's layer and expert counts at tiny
widths (default Qwen3-235B-A22B: 94 layers x 128 experts, 36,945 checkpoint tensors), started with
an empty numba cache (`NUMBA_CACHE_DIR` a fresh directory), so the first push pays whatever a
user's first push pays. Deltas (0.5 %, then 2 %) are pushed over HTTP; each response's `trace`
says where the time went. The baseline is vLLM's own in-place full reload of the final checkpoint
on the same engine (`reload_weights(weights_path=...)`, which re-runs the post-load steps, as our
commit must), median of 3. At the end the served weights are checked against vLLM's fresh load of
the final checkpoint (harness/fresh_load.py: other code than ours).

    taskset -c 0,1 python benchmarks/e2e_sync.py [--model qwen3-235b-a22b] [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_SPEC = importlib.util.spec_from_file_location("scale", ROOT / "benchmarks" / "scale.py")
scale = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scale)

KEY = "e2e-bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def run(model: str, layers: int | None, densities: tuple[float, ...], work: Path) -> dict[str, Any]:
    import requests
    from harness.fresh_load import FreshLoader, save_checkpoint
    from harness.vllm_engine import VllmServer

    base = scale.count_true_checkpoint(model, work / "base", layers)
    root = work / "root"
    root.mkdir()
    weights = scale.write_deltas(base, root, densities)
    tensors = len(weights)
    final = save_checkpoint(weights, like=base, out=work / "final")
    out: dict[str, Any] = {"model": model, "layers": layers, "checkpoint_tensors": tensors, "pushes": []}
    started = time.perf_counter()
    env = {"NUMBA_CACHE_DIR": str(work / "numba_cache")}  # empty: the first push pays any compile
    args = ["--enable-delta-updates", "--delta-updates-root", str(root), "--api-key", KEY]
    with VllmServer(base, work / "serve.log", extra_args=args, env=env, startup_timeout_s=3600) as server:
        out["healthy_s"] = time.perf_counter() - started
        while True:
            status = requests.get(f"{server.url}/delta_updates/status", headers=HEADERS, timeout=60).json()
            # Ready to update: placement learned (and kernels compiled) and the ranks' coverage checked.
            if status["placement"]["ready"] and status["placement"].get("coverage"):
                break
            time.sleep(0.2)
        out["ready_s"] = time.perf_counter() - started
        for v, density in enumerate(densities, start=1):
            t0 = time.perf_counter()
            r = requests.post(
                f"{server.url}/update_weights_delta",
                headers=HEADERS,
                timeout=3600,
                json={"path": f"v{v}", "version": v, "base_version": v - 1},
            )
            wall = time.perf_counter() - t0
            r.raise_for_status()
            body = r.json()
            out["pushes"].append(
                {
                    "version": v,
                    "density": density,
                    "wall_s": wall,
                    "changed": body["changed"],
                    "prepare_s": body.get("prepare_s"),
                    "pause_s": body.get("pause_s"),
                    "trace": body.get("trace"),
                    "outside_trace_s": wall - (body.get("trace") or {}).get("wall_s", 0.0),
                }
            )
        served = requests.post(
            f"{server.url}/weight_checker", json={"action": "checksum"}, headers=HEADERS, timeout=600
        ).json()["checksums"]
        reloads = []
        for _ in range(3):
            t0 = time.perf_counter()
            rr = requests.post(
                f"{server.url}/collective_rpc",
                headers=HEADERS,
                timeout=3600,
                json={"method": "reload_weights", "kwargs": {"weights_path": str(final)}},
            )
            rr.raise_for_status()
            reloads.append(time.perf_counter() - t0)
        out["reload_s"] = reloads
    loader = FreshLoader()
    try:
        out["bitexact_vs_fresh_load"] = served == loader.checksums(final)
    finally:
        loader.close()
    full = statistics.median(reloads)
    for push in out["pushes"]:
        push["vs_reload"] = push["wall_s"] / full
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-235b-a22b", choices=sorted(scale.MODELS))
    ap.add_argument("--layers", type=int, default=None, help="cut the model to N layers (default: all)")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="e2e_sync_") as tmp:
        result = run(a.model, a.layers, tuple(a.densities), Path(tmp))
    for push in result["pushes"]:
        phases = (push["trace"] or {}).get("phases", {})
        print(
            f"v{push['version']} {push['density']:.1%}: {push['wall_s']:.3f} s end to end "
            f"({push['vs_reload']:.3f}x reload), pause {push['pause_s']}, phases {phases}"
        )
    print(f"reload_weights: {result['reload_s']}; bit-exact: {result['bitexact_vs_fresh_load']}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "pushes"}))


if __name__ == "__main__":
    main()
