"""The wire reader's fixed cost per checkpoint tensor on GLM-4.7's tensor count (issue 16, session 7).

Why: prepare on the tensor-count-true engine pays a fixed cost per checkpoint tensor, and the reader
(manifest, flush metadata, decoder checks, result objects) was about half of it. This times what
prepare asks of the reader, in process, on vLLM's own `Glm4MoeForCausalLM` at tiny widths with
GLM-4.7's counts (92 layers x 160 experts: 44,189 tensors): `open_delta` (manifest) and a lazy
`iter_delta` with this rank's owned ranges, one decode thread, the garbage collector paused as
prepare pauses it. The delta is written once with the real writer into `--deltas` and reused, so
an A/B of two code versions reads the same bytes (run this file from each checkout).

    taskset -c 0 python benchmarks/reader_per_tensor.py --deltas /tmp/rpt [--density 1e-9] [--prepare] [--parts]
    ... --profile prepare --sort cumulative     # cProfile one prepare instead of timing

`--parts` also times prepare's three parts apart, each round (CPU time, collector paused as prepare
pauses it): the manifest (`open_delta`), the reader on the opened delta (decoded batches into a list)
and staging that list (`DeltaApplier.stage`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness.perturb import perturb_tensor  # noqa: E402

import vllm_delta  # noqa: E402
from benchmarks import scale  # noqa: E402
from benchmarks.device_check import write_delta  # noqa: E402
from vllm_delta.engine.apply import DeltaApplier  # noqa: E402
from vllm_delta.engine.placement import owned_by_tensor  # noqa: E402
from vllm_delta.wire import iter_delta, open_delta  # noqa: E402
from vllm_delta.wire.container import paused_gc  # noqa: E402
from vllm_delta.wire.deltas import DeltaBatch  # noqa: E402

MODEL = "glm-4.7-355b-a32b"


def read_all(path: Path, checkpoint, owned) -> int:
    """What prepare asks of the reader: open the delta, then iterate lazily with the owned ranges, in
    decoded batches; the tensors read."""
    with paused_gc():
        info = open_delta(path)
        return sum(
            len(d) if isinstance(d, DeltaBatch) else 1  # tensors
            for d in iter_delta(
                info, expected=checkpoint, current_version=0, owned=owned, lazy=True, threads=1, batches=True
            )
        )


def parts(applier: DeltaApplier, path: Path, checkpoint) -> dict[str, float]:
    """CPU seconds of prepare's parts, each alone: the manifest, the reader on the opened delta (into a
    list), staging that list."""
    out = {}
    with paused_gc():
        cpu = time.process_time()
        info = open_delta(path)
        out["manifest"] = time.process_time() - cpu
        cpu = time.process_time()
        decoder = applier._decoder()
        items = list(
            iter_delta(
                info,
                expected=checkpoint,
                current_version=0,
                owned=applier.owned_ranges(),
                lazy=True,
                threads=1,
                batches=True,
                decoder=decoder,
            )
        )
        out["decode"] = time.process_time() - cpu
        cpu = time.process_time()
        applier.stage(info.manifest, items, version=1, replay=False, start=0.0, decoder=decoder)
        out["stage"] = time.process_time() - cpu
        del info, items
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=92)
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--deltas", type=Path, required=True, help="where the delta is written once and reused")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--prepare", action="store_true", help="also time DeltaApplier.prepare (one decode thread)"
    )
    ap.add_argument(
        "--parts", action="store_true", help="also time the manifest, the reader and staging apart"
    )
    ap.add_argument("--profile", choices=("reader", "prepare"), help="cProfile one run instead of timing")
    ap.add_argument(
        "--sort", default="tottime", help="the profile's order (pstats keys: tottime, cumulative)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config

    checkpoint = scale.checkpoint_shapes(MODEL, args.layers, shrink=True, experts=args.experts)
    config = scale.engine_config(MODEL, 1, False, args.layers, shrink=True, experts=args.experts)
    model = scale.meta_model(config, 1, 0, False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    base = {n: (torch.randn(s, generator=gen) * 0.05).to(dtype) for n, (s, dtype) in checkpoint.items()}
    path = args.deltas / f"glm_{args.layers}x{args.experts}_{args.density}"
    if not (path / "manifest.json").exists():
        write_delta(path, base, {n: perturb_tensor(t, args.density, gen) for n, t in base.items()}, version=1)
    with scale.fake_parallel(1, 0, False), set_current_vllm_config(config):
        model.load_weights(base.items())
        applier = DeltaApplier(model, checkpoint, model.load_weights)
        owned = owned_by_tensor(applier.placements)  # the startup probe, outside every timing

        def prepare():
            return applier.prepare(path, version=1, base_version=0, current_version=0, decode_threads=1)

        if args.profile:
            prepare()  # warm: what the applier works out once (landings, owned ranges) stays out of the profile
            prof = cProfile.Profile()
            prof.runcall(prepare if args.profile == "prepare" else lambda: read_all(path, checkpoint, owned))
            pstats.Stats(prof).sort_stats(args.sort).print_stats(40)
            return 0
        info = open_delta(path)
        row = {
            "tensors": len(info.manifest.params),
            "files": len(info.manifest.files),
            "changes": info.manifest.changed,
            "wire_bytes": info.manifest.total_bytes,
            "package": str(Path(vllm_delta.__file__).parents[1]),
        }
        samples: dict[str, list[float]] = {}
        runs = [("reader", lambda: read_all(path, checkpoint, owned))] + [("prepare", prepare)] * args.prepare
        for _ in range(args.repeat):  # interleaved: reader, then prepare, each round
            for what, run in runs:
                wall, cpu = (
                    time.perf_counter(),
                    time.process_time(),
                )  # CPU time: what other load cannot inflate
                run()
                samples.setdefault(f"{what}_s", []).append(time.perf_counter() - wall)
                samples.setdefault(f"{what}_cpu_s", []).append(time.process_time() - cpu)
            if args.parts:
                for what, seconds in parts(applier, path, checkpoint).items():
                    samples.setdefault(f"{what}_cpu_s", []).append(seconds)
        for key, values in samples.items():
            row[key] = values
            row[key.replace("_s", "_us_per_tensor")] = round(
                1e6 * statistics.median(values) / row["tensors"], 2
            )
        row["load"] = os.getloadavg()[0]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
