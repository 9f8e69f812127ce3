#!/usr/bin/env python3
"""Megatron demo: megatron-core at TP=2 x EP=2 (4 gloo processes, CPU) syncs a real
`vllm serve --enable-delta-updates` (TP=2) through the post-optimizer-step hook.

A tiny Qwen3-MoE-style HF checkpoint is served, loaded into megatron-core through mbridge, and
trained for a few steps at an RL-like learning rate (`LR`); after each step the hook diffs every
rank's own shard in HF coordinates and publishes disk deltas while the next step runs. `bitexact`
is independent of the hook: mbridge's own export of the final trainer weights is loaded into a
fresh engine, whose `/weight_checker` digests and greedy completion must equal the synced engine's.
The last line printed is one JSON summary (per sync: density, wire bytes, full-sync bytes); a plot
goes to docs/results/megatron_demo.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(
    0, str(REPO / "tests")
)  # the tiny-model builder, the megatron CPU shim and the server harness

from harness import megatron_cpu  # noqa: E402
from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402

API_KEY = "megatron-demo-key"
PROMPT = "The quick brown fox"
# An RL-like learning rate, not pre-training's: at 1e-3 most bf16 weights changed every step (density
# 0.78-0.85); at 3e-6 1.2-1.8% of this model's bf16 elements change bit-wise per step (1e-6 gave ~0.5%),
# within the 1-5% RL runs see, which is what delta sync is for.
LR = 3e-6


def worker(
    rank: int, world: int, port: int, hf: str, url: str, root: str, version: int, steps: int, out: str
) -> None:
    """One trainer rank: build from the checkpoint, register the hook, train, export (rank 0 writes)."""
    import shutil

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port, tp=2, ep=2)
    from megatron_hook import register
    from vllm_delta import DeltaSender

    model, opt, gpt, bridge = megatron_cpu.build_from_hf(hf, lr=LR)
    model.eval()  # MoE with TP>1 trains only with sequence parallel, which the local spec refuses
    group = dist.new_group(backend="gloo")
    sender = DeltaSender(
        [url], "disk", root, api_key=API_KEY, group=group, version=version, flush_bytes=256 << 10
    )
    log: list[dict] = []

    def on_sync(m: dict) -> None:
        log.append(m)
        if rank == 0:
            print(
                f"sync {len(log)}: version {int(m['sender/version'])} density "
                f"{m['perf/update_weights_density']:.4f} "
                f"wire {int(m['perf/update_weights_wire_bytes'])} B  publish "
                f"{m['perf/update_weights_time']:.2f} s  "
                f"acked {bool(m['sender/all_acked'])}",
                flush=True,
            )

    handle = register(opt, [model], sender, bridge=bridge, checkpoint=hf, on_sync=on_sync)
    if rank == 0:
        print(
            f"registered: {len(handle.segments)} segments on rank 0; seed mismatches "
            f"{handle.seed_report.total}",
            flush=True,
        )
    step_s = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step)
        t = time.perf_counter()
        megatron_cpu.train_step(model, opt, torch.randint(0, 512, (2, 17), generator=gen))
        step_s.append(time.perf_counter() - t)
    handle.remove()
    sender.close()
    final = megatron_cpu.export_hf(bridge, gpt)  # mbridge's own export, independent of the hook's map
    if rank == 0:
        dest = Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        for f in Path(hf).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and "index" not in f.name:
                shutil.copy2(f, dest / f.name)
        save_file({n: t.contiguous() for n, t in final.items()}, dest / "model.safetensors")
        full = sum(t.numel() * t.element_size() for t in final.values())
        (dest.parent / "syncs.json").write_text(
            json.dumps(
                {
                    "syncs": log,
                    "step_s": step_s,
                    "seed_mismatches": handle.seed_report.total,
                    "full_bytes": full,
                }
            )
        )


def _checksums(server: VllmServer) -> dict:
    r = requests.post(
        f"{server.url}/weight_checker",
        json={"action": "checksum"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["checksums"]


def _version(server: VllmServer) -> int:
    r = requests.get(
        f"{server.url}/delta_updates/status", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    r.raise_for_status()
    return int(r.json()["version"])


def _greedy(server: VllmServer) -> str:
    """Greedy completion through the OpenAI route (the key is required there too)."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = requests.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _serve(model: Path, root: Path, log: Path, tp: int) -> VllmServer:
    return VllmServer(
        model,
        log,
        tp=tp,
        extra_args=["--enable-delta-updates", "--delta-updates-root", str(root), "--api-key", API_KEY],
    )


def hidden_fraction(syncs: list[dict]) -> float:
    """Share of publish time that ran behind training: publish i overlapped step i+1 except for
    the time capture i+1 waited for it (the last publish has no next step and counts as exposed)."""
    publish = [m["perf/update_weights_time"] - m["sender/capture_s"] for m in syncs]
    waits = [m["sender/capture_wait_s"] for m in syncs[1:]] + [publish[-1]]
    return sum(max(0.0, p - w) for p, w in zip(publish, waits)) / max(1e-9, sum(publish))


def plot(syncs: list[dict], full_bytes: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(1, len(syncs) + 1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.bar(xs, [m["perf/update_weights_wire_bytes"] / 1e3 for m in syncs], label="delta (wire)")
    a.axhline(full_bytes / 1e3, color="gray", ls="--", label="full sync")
    a.set(xlabel="sync", ylabel="kB", title="bytes per sync")
    a.legend()
    b.plot(xs, [m["perf/update_weights_density"] for m in syncs], marker="o")
    b.set(xlabel="sync", ylabel="changed fraction", title="density (TP=2 x EP=2 megatron)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=REPO / "docs/results/megatron_demo.png")
    args = ap.parse_args()
    started = time.perf_counter()
    work = Path(os.path.realpath(tempfile.mkdtemp(prefix="vllm-delta-megatron-demo-")))
    hf = make_tiny_model("qwen3_moe", work / "model")
    root = work / "deltas"
    root.mkdir()
    final = work / "final" / "model"
    with _serve(hf, root, work / "serve.log", args.engine_tp) as server:
        version = _version(server)
        megatron_cpu.spawn(
            worker, 4, str(hf), server.url, str(root), version, args.steps, str(final), timeout=1200
        )
        engine_version = _version(server)
        synced = _checksums(server)
        greedy = _greedy(server)
    with _serve(final, final, work / "fresh.log", args.engine_tp) as fresh:
        digests_equal = _checksums(fresh) == synced
        greedy_equal = _greedy(fresh) == greedy
    info = json.loads((work / "final" / "syncs.json").read_text())
    syncs = info["syncs"]
    plot(syncs, info["full_bytes"], args.plot)
    n = len(syncs)
    summary = {
        "demo": "megatron",
        "bitexact": bool(digests_equal and greedy_equal and all(m["sender/all_acked"] == 1.0 for m in syncs)),
        "syncs": n,
        "engine_version": engine_version,
        "lr": LR,
        "density_mean": sum(m["perf/update_weights_density"] for m in syncs) / max(1, n),
        "per_sync": [
            {
                "sync": i,
                "density": round(m["perf/update_weights_density"], 5),
                "wire_bytes": int(m["perf/update_weights_wire_bytes"]),
                "full_sync_bytes": int(info["full_bytes"]),
            }
            for i, m in enumerate(syncs, 1)
        ],
        "wire_bytes_total": int(sum(m["perf/update_weights_wire_bytes"] for m in syncs)),
        "full_sync_bytes": int(info["full_bytes"] * n),
        "sync_seconds_mean": sum(m["perf/update_weights_time"] for m in syncs) / max(1, n),
        "hidden_fraction": round(hidden_fraction(syncs), 3) if syncs else 0.0,
        "digests_equal": digests_equal,
        "greedy_equal": greedy_equal,
        "seed_mismatches": info["seed_mismatches"],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(f"plot: {args.plot}")
    print(json.dumps(summary))
    return 0 if summary["bitexact"] else 1


if __name__ == "__main__":
    sys.exit(main())
