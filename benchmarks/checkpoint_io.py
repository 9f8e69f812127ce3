"""Offline tools on a many-tensor checkpoint: `vllm-delta diff`, `apply` and `verify --base` against
reading the checkpoint (every shard, `safetensors.torch.load_file`) twice, in wall and CPU seconds.

The checkpoint has the tensor count of a 94-layer x 128-expert MoE (3 small tensors per expert,
36,096 tensors), sharded into `--shards` files with a `model.safetensors.index.json`. NEW moves
about 1% of OLD's elements by one ULP. Each tool runs in a fresh process (`python -m vllm_delta.cli`),
as a user would run it, under the same `taskset` pinning; medians of `--runs` runs.
Writes docs/results/checkpoint_io.json (the figures docs/results/checkpoint_io.md quotes).

    taskset -c 1 python benchmarks/checkpoint_io.py [--layers 94] [--experts 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX_NAME = "model.safetensors.index.json"
SHAPE = (16, 64)  # bf16: 2 KiB per tensor, ~74 MB per checkpoint at 94 x 128 x 3


def write(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        keys = names[i * per : (i + 1) * per]
        save_file({k: tensors[k] for k in keys}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def build(root: Path, layers: int, experts: int, shards: int) -> tuple[Path, Path, int]:
    g = torch.Generator().manual_seed(0)
    old = {
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": torch.randn(SHAPE, generator=g).bfloat16()
        for layer in range(layers)
        for e in range(experts)
        for p in ("gate", "up", "down")
    }
    new = {}
    for name, t in old.items():
        moved = torch.rand(t.shape, generator=g) < 0.01
        bits = t.view(torch.int16).clone()
        bits[moved] += 1
        new[name] = bits.view(torch.bfloat16)
    write(root / "old", old, shards)
    write(root / "new", new, shards)
    return root / "old", root / "new", len(old)


def timed(cmd: list[str], limit: float) -> tuple[float, float] | None:
    """(wall s, CPU s) `cmd` took, or None if it was still running after `limit` s (then killed).
    CPU time is reported too: other work shares these cores, and it stretches the wall time."""
    start, cpu = time.perf_counter(), _child_cpu()
    try:
        subprocess.run(cmd, check=True, timeout=limit, stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - start, _child_cpu() - cpu


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def read_twice(ckpt: Path) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(2):
        for f in sorted(ckpt.glob("*.safetensors")):
            load_file(f)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=94)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=float, default=900.0, help="seconds before one tool run is given up")
    ap.add_argument("--out", type=Path, default=Path("docs/results/checkpoint_io.json"))
    a = ap.parse_args()
    py = [sys.executable, "-m", "vllm_delta.cli"]
    root = Path(tempfile.mkdtemp(prefix="ckpt-io-"))
    try:
        old, new, count = build(root, a.layers, a.experts, a.shards)
        size = sum(f.stat().st_size for f in old.glob("*.safetensors"))
        runs: dict[str, list[tuple[float, float] | None]] = {
            "read_twice": [],
            "diff": [],
            "apply": [],
            "verify": [],
        }
        for _ in range(a.runs):
            for d in ("delta", "applied"):
                shutil.rmtree(root / d, ignore_errors=True)
            runs["read_twice"].append(read_twice(old))
            runs["diff"].append(timed([*py, "diff", str(old), str(new), str(root / "delta")], a.limit))
            if runs["diff"][-1] is None:
                break  # nothing to apply or verify
            runs["apply"].append(
                timed([*py, "apply", str(old), str(root / "delta"), str(root / "applied")], a.limit)
            )
            runs["verify"].append(timed([*py, "verify", str(root / "delta"), "--base", str(old)], a.limit))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    done = {k: v for k, v in runs.items() if v and None not in v}
    med = {
        k: {"wall": statistics.median(w for w, _ in v), "cpu": statistics.median(c for _, c in v)}
        for k, v in done.items()
    }
    result = {
        "tensors": count,
        "shards": a.shards,
        "checkpoint_bytes": size,
        "runs": runs,
        "median_s": med,
        "limit_s": a.limit,
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
