"""Prepare's staging (locate, digests, staging from decoded deltas) per checkpoint tensor, on vLLM's own
Glm4Moe at tiny widths (benchmarks/cost_model.py's setup), in process.

Why apart from cost_model.py: the staging's fixed cost per tensor is a few microseconds, below this
machine's noise in one fit; here two expert counts at the same layers (the same destinations)
are timed many times each and the slope between them is the cost per added tensor (its changes
included: each expert adds a few dozen at 0.5%). `ROOT=<checkout>` times another checkout's code.

    taskset -c 1 .venv/bin/python benchmarks/stage_per_tensor.py [--layers 14] [--experts 40 160]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.environ.get("ROOT", str(Path(__file__).resolve().parents[1]))
sys.path[:0] = [ROOT, ROOT + "/tests"]

import torch  # noqa: E402
from harness.perturb import perturb_tensor  # noqa: E402

from benchmarks import scale  # noqa: E402
from benchmarks.device_check import write_delta  # noqa: E402
from vllm_delta.engine.apply import DeltaApplier  # noqa: E402
from vllm_delta.wire import iter_delta, open_delta  # noqa: E402
from vllm_delta.wire.container import paused_gc  # noqa: E402
from vllm_delta.wire.deltas import DeltaBatch  # noqa: E402

MODEL = "glm-4.7-355b-a32b"


def timed(layers: int, experts: int, density: float, repeats: int) -> dict:
    """Stage times of one delta on one model: tensors, destinations, changes, median and min seconds."""
    from vllm.config import set_current_vllm_config

    checkpoint = scale.checkpoint_shapes(MODEL, layers, shrink=True, experts=experts)
    config = scale.engine_config(MODEL, 1, False, layers, shrink=True, experts=experts)
    model = scale.meta_model(config, 1, 0, False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    base = {n: (torch.randn(s, generator=gen) * 0.05).to(dtype) for n, (s, dtype) in checkpoint.items()}
    with (
        scale.fake_parallel(1, 0, False),
        set_current_vllm_config(config),
        tempfile.TemporaryDirectory() as tmp,
    ):
        model.load_weights(base.items())
        applier = DeltaApplier(model, checkpoint, model.load_weights)
        _ = applier.placements  # the startup probe, outside the timing
        path = Path(tmp) / "v1"
        write_delta(path, base, {n: perturb_tensor(t, density, gen) for n, t in base.items()}, version=1)
        info = open_delta(path)
        deltas = list(
            iter_delta(info, expected=checkpoint, current_version=0, lazy=True, batches=True)
        )  # as prepare
        times = []
        for _ in range(repeats):
            with paused_gc():  # as prepare runs it
                start = time.perf_counter()
                staged = applier.stage(info.manifest, deltas, version=1, replay=False, start=start)
                times.append(time.perf_counter() - start)
    return {
        "layers": layers,
        "experts": experts,
        "tensors": sum(len(d) if isinstance(d, DeltaBatch) else 1 for d in deltas),
        "destinations": len(staged.writes),
        "changes": staged.changed,
        "median_s": statistics.median(times),
        "min_s": min(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--experts", type=int, nargs=2, default=[40, 160])
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    few, many = (timed(args.layers, e, args.density, args.repeats) for e in args.experts)
    extra = many["tensors"] - few["tensors"]
    print(
        json.dumps(
            {
                "few": few,
                "many": many,
                "per_tensor_us_median": 1e6 * (many["median_s"] - few["median_s"]) / extra,
                "per_tensor_us_min": 1e6 * (many["min_s"] - few["min_s"]) / extra,
            }
        )
    )


if __name__ == "__main__":
    main()
