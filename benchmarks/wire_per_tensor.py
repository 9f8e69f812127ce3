"""Per-checkpoint-tensor cost of reading a delta (issue 16): the wire reader alone, and `DeltaApplier.prepare`.

Why: prepare on a production tensor count was flat in the density (0.33 ms a tensor on the
tensor-count-true engine), so a fixed per-tensor cost dominates. This times it in-process on
benchmarks/device_check.py's synthetic MoE model (hidden 64, thousands of expert tensors feeding
fused w13/w2 params, no vLLM). Deltas are written once with the real writer (block-indexed flushes,
as the sender writes them) into `--deltas` and reused, so an A/B of two code versions reads the
same bytes (run this file from each checkout: it imports the package beside it).

    taskset -c 1 python benchmarks/wire_per_tensor.py --moe-layers 16 --moe-experts 128 --deltas /tmp/d
    ... --profile ulp_zstd:0.02    # cProfile one prepare instead of timing
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check as dc  # noqa: E402

import vllm_delta  # noqa: E402
from vllm_delta.engine.apply import DeltaApplier  # noqa: E402
from vllm_delta.engine.placement import owned_by_tensor  # noqa: E402
from vllm_delta.wire import get_encoding, iter_delta, open_delta  # noqa: E402


def ensure_delta(path: Path, cfg: dc.Config, encoding: str, density: float) -> None:
    """The delta base -> one optimizer-like step at `density`, written once (version 1 on base 0)."""
    if (path / "manifest.json").exists():
        return
    base = dc.random_checkpoint(cfg, "cpu", seed=0)
    dc.write_delta(path, base, dc.step(base, density, seed=1), version=1, encoding=encoding)


def read_all(path: Path, meta, owned, needs_base: bool) -> int:
    """What prepare asks of the wire reader: open, then iterate lazily with this rank's owned ranges."""
    info = open_delta(path)
    return sum(
        d.count
        for d in iter_delta(
            info, expected=meta, current_version=0 if needs_base else None, owned=owned, lazy=True
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe-layers", type=int, default=16)
    ap.add_argument("--moe-experts", type=int, default=128)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02])
    ap.add_argument("--encodings", nargs="+", default=["ulp_zstd", "deltas_zstd"])
    ap.add_argument("--deltas", type=Path, required=True, help="where the deltas are written once and reused")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-prepare", action="store_true", help="time the reader only")
    ap.add_argument("--profile", default=None, help="ENCODING:DENSITY: cProfile one prepare, print the top")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ns = argparse.Namespace(device="cpu", moe_layers=args.moe_layers, moe_experts=args.moe_experts)
    cfg = dc.moe_config(ns)
    shapes = dc.checkpoint_shapes(cfg)
    meta = {n: (s, torch.bfloat16) for n, s in shapes.items()}
    cases = [(e, d) for e in args.encodings for d in args.densities]
    if args.profile:
        e, d = args.profile.split(":")
        cases = [(e, float(d))]
    for e, d in cases:
        ensure_delta(args.deltas / f"{e}_{d}", cfg, e, d)
    applier = None
    if not args.no_prepare or args.profile:
        model = dc.SyntheticLM(cfg, device="cpu")
        model.load_weights(dc.random_checkpoint(cfg, "cpu", seed=0).items())
        applier = DeltaApplier(model, meta)
        owned = owned_by_tensor(applier.placements)
    else:
        owned = {n: None for n in shapes}
    for e, d in cases:
        path = args.deltas / f"{e}_{d}"
        needs_base = get_encoding(e).needs_base

        def prepare():
            return applier.prepare(path, version=1, base_version=0, current_version=0)

        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(prepare)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return 0
        info = open_delta(path)
        row = {
            "encoding": e,
            "density": d,
            "tensors": len(info.manifest.params),
            "files": len(info.manifest.files),
            "changes": sum(p.changed for p in info.manifest.params),
            "wire_bytes": info.manifest.total_bytes,
            "package": str(Path(vllm_delta.__file__).parents[1]),
        }
        reads, preps = [], []
        for _ in range(args.repeat):  # interleaved: reader, then prepare, each round
            t = time.perf_counter()
            read_all(path, meta, owned, needs_base)
            reads.append(time.perf_counter() - t)
            if applier is not None:
                t = time.perf_counter()
                prepare()
                preps.append(time.perf_counter() - t)
        row["iter_s"] = statistics.median(reads)
        row["iter_us_per_tensor"] = 1e6 * row["iter_s"] / row["tensors"]
        if preps:
            row["prepare_s"] = statistics.median(preps)
            row["prepare_us_per_tensor"] = 1e6 * row["prepare_s"] / row["tensors"]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
