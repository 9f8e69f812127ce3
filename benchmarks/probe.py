"""Placement probe benchmark: the probe alone, on `benchmarks/apply.py`'s model, in one engine.

Why a separate script: the full apply benchmark takes minutes per density; the probe runs once
at engine start and only needs the engine up. Optionally (`--old FILE`, a copy of an earlier
`vllm_delta/engine/placement.py`) the earlier probe runs in the same worker, after ours, on the
same parameters, for a before/after from one run. `--synthetic TP` instead probes rank 0 of
`device_check.SyntheticLM` (vLLM-shaped loaders: TP slices, fused qkv / gate_up, experts) of the
same size, without vLLM. Prints one JSON line.

    flock /tmp/engine.lock .venv/bin/python benchmarks/probe.py [--layers 28] [--old /tmp/old_placement.py]
    .venv/bin/python benchmarks/probe.py --synthetic 2 [--old /tmp/old_placement.py]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks import _probe_worker as PW  # noqa: E402
from benchmarks.apply import llama_config, make_base, write_model  # noqa: E402


def synthetic(a: argparse.Namespace) -> dict:
    import torch

    from benchmarks.device_check import Config, SyntheticLM, checkpoint_shapes
    from vllm_delta.engine.probe import PeakRss, build_placement

    cfg = Config(
        vocab=32000,
        hidden=a.hidden,
        layers=a.layers,
        heads=16,
        kv_heads=8,
        head_dim=a.hidden // 16,
        inter=a.intermediate,
        moe_layers=2,
        experts=8,
        moe_inter=a.intermediate // 4,
    )
    model = SyntheticLM(cfg, rank=0, tp=a.synthetic)
    checkpoint = {n: (s, torch.bfloat16) for n, s in checkpoint_shapes(cfg).items()}
    storages = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    probes = {"new": build_placement}
    if a.old:
        probes["old"] = PW.load_module(str(a.old)).build_placement
    import torch._dynamo  # noqa: F401  (vLLM has it imported; the first dispatch mode would import it)

    out: dict = {"params": sum(torch.Size(s).numel() for s, _ in checkpoint.values()), "tp": a.synthetic}
    found = {}
    for label, probe in probes.items():
        with PeakRss() as peak:
            t = time.perf_counter()
            placements = probe(model.load_weights, storages, checkpoint)
            seconds = time.perf_counter() - t
        out[label] = {
            "probe_s": seconds,
            "probe_peak_bytes": peak.extra,
            "fallback": sorted(n for n, p in placements.items() if p.fallback_reason),
        }
        found[label] = PW.segments(placements)
    if a.old:
        out["same_segments"] = found["new"] == found["old"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--old", type=Path, help="an earlier placement.py to time in the same worker")
    p.add_argument("--synthetic", type=int, metavar="TP", help="probe a synthetic TP rank, no engine")
    a = p.parse_args()
    if a.synthetic:
        print(json.dumps(synthetic(a)))
        return
    import os

    from harness.vllm_engine import start_llm

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="probe-bench-"))
    try:
        cfg = llama_config(a)
        base = make_base(cfg)
        out = {"params": sum(t.numel() for t in base.values()), "tensors": len(base)}
        write_model(cfg, work / "base", base)
        del base
        with start_llm(work / "base", delta=True) as llm:
            out["new"] = llm.collective_rpc(PW.probe, args=())[0]
            replies = llm.collective_rpc("delta_coverage")
            t = time.perf_counter()
            checked = llm.collective_rpc("delta_set_peers", args=(replies,))
            out["coverage_s"] = time.perf_counter() - t
            out["coverage"] = checked[0]["coverage"]
            if a.old:
                out["old"] = llm.collective_rpc(PW.old_probe, args=(str(a.old),))[0]
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
