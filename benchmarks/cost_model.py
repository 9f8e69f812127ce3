"""The receiver's per-sync cost model (issue 16): per checkpoint tensor, per destination, per change.

Why a model: a CPU here cannot hold a 355B engine, so what we can measure is the cost per unit on
vLLM's own GLM-4.7 model class (`Glm4MoeForCausalLM`) at the real tensor structure and tiny widths,
in process (no server, no CPU repack), on a grid that varies the three counts independently:
layers (destinations and tensors), experts per layer (tensors only: they feed the same fused
params) and density (changes only). Each part of a sync is fitted to

    t = per_tensor * T + per_destination * D + per_change * C        (least squares, coefficients >= 0)

with T checkpoint tensors in the delta, D destination params written, C changes. The parts:
`decode` (the wire reader: read, file hash, decompress, decode; host-only work on any device),
`stage` (locate, digests, staging from decoded deltas) and `commit` (scatter, read-back). The torch
ops of stage + commit are counted with a TorchDispatchMode (the GPU's launch-count proxy).

The node projection (GLM-4.7-355B, TP=8 on one 8xH200 node, 2%) uses the fitted host-side decode
costs, which run on the node's CPUs as they do here, and for the device side the counted ops and
bytes, with the GPU's rates as stated assumptions. It is a projection, not a GPU figure:

    decode_s     = (decode_wide.per_tensor * T_r + decode_wide.per_change * C_r) / host_threads
    host_stage_s = (stage.per_tensor + commit.per_tensor) * T_r
    h2d_s        = staged_bytes_per_change * C_r / pcie_bytes_per_s
    device_s     = ops_per_destination * D_r * launch_s + device_bytes_per_change * C_r / hbm_bytes_per_s
    node_s       = decode_s + host_stage_s + h2d_s + device_s     (no overlap assumed: an upper bound)

`decode_wide` is the reader alone on full-width tensors (thousands of changes each, the per-param
path), which is what each rank's slice of GLM-4.7's tensors is at TP=8; the grid's tiny widths
measure the batched path of small tensors instead.

    python benchmarks/cost_model.py [--layers 6 14] [--experts 40 160] [--json PATH]
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
from typing import Any
from unittest import mock

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from harness.dispatch_log import OpCount  # noqa: E402
from harness.perturb import perturb_tensor  # noqa: E402

from benchmarks import scale  # noqa: E402
from benchmarks.device_check import write_delta  # noqa: E402
from vllm_delta.engine.apply import DeltaApplier  # noqa: E402
from vllm_delta.kernels import digest  # noqa: E402
from vllm_delta.wire import DeltaWriter, iter_delta, open_delta  # noqa: E402
from vllm_delta.wire.container import paused_gc  # noqa: E402

MODEL = "glm-4.7-355b-a32b"
# Stated assumptions for the device side of the projection (not measured here: no GPU was lent).
ASSUMED = {
    "launch_s": 8e-6,  # one small torch op on an H200, launch + tail, host-bound
    "hbm_bytes_per_s": 3.0e12,  # of H200's 4.8 TB/s peak, for gathers and scatters at 2% density
    "device_bytes_per_change": 256,  # a 32 B sector read + written per scatter/gather (4 passes) + staged arrays
    "pcie_bytes_per_s": 25e9,  # pinned host -> device, one GPU's link
    # Decode threads per rank: what worker_transfer.decode_threads gives each of 8 local GPUs on a node
    # with >= 64 usable cores; the decode is measured here at one thread and assumed to scale across
    # flushes.
    "host_threads": 8,
}


def _point(layers: int, experts: int, densities: tuple[float, ...], repeats: int) -> list[dict[str, Any]]:
    """One model size: decode / stage / commit medians and the ops of one sync, per density."""
    from vllm.config import set_current_vllm_config

    checkpoint = scale.checkpoint_shapes(MODEL, layers, shrink=True, experts=experts)
    config = scale.engine_config(MODEL, 1, False, layers, shrink=True, experts=experts)
    model = scale.meta_model(config, 1, 0, False, device="cpu")
    gen = torch.Generator().manual_seed(0)
    base = {n: (torch.randn(s, generator=gen) * 0.05).to(dtype) for n, (s, dtype) in checkpoint.items()}
    rows = []
    with (
        scale.fake_parallel(1, 0, False),
        set_current_vllm_config(config),
        tempfile.TemporaryDirectory(prefix="cost_model_") as tmp,
    ):
        model.load_weights(base.items())
        applier = DeltaApplier(model, checkpoint, model.load_weights)
        _ = applier.placements  # the startup probe, outside every timing
        for version, density in enumerate(densities, start=1):
            new = {n: perturb_tensor(t, density, gen) for n, t in base.items()}
            path = Path(tmp) / f"v{version}"
            write_delta(path, base, new, version=version)
            samples: dict[str, list[float]] = {"decode_s": [], "stage_s": [], "commit_s": []}
            for _ in range(repeats):
                info = open_delta(path)
                with paused_gc():  # as DeltaApplier.prepare runs them
                    start = time.perf_counter()
                    deltas = list(
                        iter_delta(info, expected=checkpoint, current_version=version - 1, lazy=True)
                    )
                    samples["decode_s"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    staged = applier.stage(info.manifest, deltas, version=version, replay=False, start=start)
                    samples["stage_s"].append(time.perf_counter() - start)
                samples["commit_s"].append(applier.commit(staged))
                model.load_weights(base.items())
            with OpCount() as ops:
                staged = applier.stage(info.manifest, deltas, version=version, replay=False, start=0.0)
                changed, staged_bytes, destinations = staged.changed, staged.staged_bytes, len(staged.writes)
                applier.commit(staged)
            model.load_weights(base.items())
            # On a device the digests are torch ops in one pass, not the CPU kernel or the CPU's
            # cache-sized slices: count them that way.
            with (
                mock.patch.object(digest, "CPU_SLICE", 1 << 62),
                mock.patch.dict(os.environ, {"VLLM_DELTA_KERNELS": "0"}),
                OpCount() as device_ops,
            ):
                applier.commit(applier.stage(info.manifest, deltas, version=version, replay=False, start=0.0))
            model.load_weights(base.items())
            rows.append(
                {
                    "layers": layers,
                    "experts": experts,
                    "density": density,
                    "tensors": len(deltas),
                    "destinations": destinations,
                    "changes": changed,
                    "staged_bytes": staged_bytes,
                    "ops": ops.count,
                    "device_ops": device_ops.count,
                    **{k: statistics.median(v) for k, v in samples.items()},
                    "samples": samples,
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), flush=True)
    return rows


def _wide_decode(repeats: int, numel: int = 1 << 22) -> list[dict[str, Any]]:
    """The reader alone on full-width tensors, where each tensor has >= wire.batch.PER_PARAM_ENTRIES changes
    a rank and so decodes on the per-param path (as GLM-4.7's experts do at TP=8: ~20 k changes a rank at 2%):
    the same changes in 24 or 96 tensors, and a quarter of them, so per tensor and per change separate."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="cost_model_wide_") as tmp:
        for tensors, size, density in ((24, numel, 0.02), (96, numel // 4, 0.02), (24, numel, 0.005)):
            path = Path(tmp) / f"{tensors}_{density}"
            with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd") as writer:
                for i in range(tensors):
                    pos = torch.randperm(size, generator=gen)[: int(size * density)].sort().values
                    old = torch.randn(pos.numel(), generator=gen).to(torch.bfloat16)
                    writer.add(
                        f"t{i}", pos, (old.view(torch.int16) + 1).view(torch.bfloat16), old, shape=(size,)
                    )
            times = []
            for _ in range(repeats):
                with paused_gc():
                    start = time.perf_counter()
                    changes = sum(d.count for d in iter_delta(open_delta(path), current_version=0, lazy=True))
                    times.append(time.perf_counter() - start)
            rows.append(
                {
                    "tensors": tensors,
                    "destinations": 0,
                    "changes": changes,
                    "decode_s": statistics.median(times),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def fit(rows: list[dict[str, Any]], part: str, columns: tuple[str, ...]) -> dict[str, float]:
    """Least squares of `part` seconds on `columns` in relative terms (each row weighted by 1/seconds,
    so the small points count as much as the large), with coefficients held >= 0 (a negative one is
    noise: it is dropped and the rest refitted)."""
    active = list(columns)
    y = np.array([r[part] for r in rows])
    while True:
        x = np.array([[r[c] for c in active] for r in rows], dtype=float)
        coef = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    out = {c: 0.0 for c in columns}
    out.update(dict(zip(active, (max(0.0, float(v)) for v in coef))))
    predicted = np.array([[r[c] for c in columns] for r in rows], dtype=float) @ np.array(
        [out[c] for c in columns]
    )
    out["max_rel_residual"] = float(np.max(np.abs(predicted - y) / y))
    return out


def node_projection(
    model_fit: dict[str, Any],
    ops_per_destination: float,
    staged_bytes_per_change: float,
    assumed: dict[str, float] = ASSUMED,
) -> dict[str, Any]:
    """GLM-4.7-355B, TP=8 on one 8xH200 node, 2%: the last rank (every rank holds a slice of every tensor)."""
    full = scale.checkpoint_shapes(MODEL)
    params = sum(torch.Size(s).numel() for s, _ in full.values())
    tp = 8
    counts = {
        "T_r": len(full),
        "D_r": 1187,
        "C_r": params * 0.02 / tp,
    }  # D_r: the full-shape harness's rank 7
    dec = model_fit[
        "decode_wide"
    ]  # at full width each rank's slice of a tensor decodes on the per-param path
    terms = {
        "decode_s": (dec["tensors"] * counts["T_r"] + dec["changes"] * counts["C_r"])
        / assumed["host_threads"],
        # the staging's Python per checkpoint tensor (pieces, tables) stays on the host, one thread
        "host_stage_s": (model_fit["stage"]["tensors"] + model_fit["commit"]["tensors"]) * counts["T_r"],
        # what crosses per change (batched.locate on a device): int32 positions and the values, as many
        # bytes as the staged offsets and values
        "h2d_s": staged_bytes_per_change * counts["C_r"] / assumed["pcie_bytes_per_s"],
        "device_s": ops_per_destination * counts["D_r"] * assumed["launch_s"]
        + assumed["device_bytes_per_change"] * counts["C_r"] / assumed["hbm_bytes_per_s"],
    }
    return {
        "params": params,
        **counts,
        **terms,
        "node_s": sum(terms.values()),
        "assumed": dict(assumed),
        "formula": "(decode_wide.per_tensor*T_r + decode_wide.per_change*C_r)/host_threads"
        " + (stage.per_tensor + commit.per_tensor)*T_r + staged_bytes_per_change*C_r/pcie"
        " + ops_per_destination*D_r*launch_s + device_bytes_per_change*C_r/hbm",
    }


def predict(part: dict[str, float], row: dict[str, Any]) -> float:
    return sum(part[c] * row[c] for c in ("tensors", "destinations", "changes"))


def cost_model(
    layers: list[int],
    experts: list[int],
    densities: tuple[float, ...],
    repeats: int,
    count_true: bool = False,
    wide_numel: int = 1 << 22,
) -> dict[str, Any]:
    """The grid's fit and the node projection; `count_true`: also GLM-4.7's own counts (92 layers x 160
    experts, 2%), out of the fit, as its check and for the op counts at the real tensor count."""
    rows = [r for n in layers for e in experts for r in _point(n, e, densities, repeats)]
    columns = ("tensors", "destinations", "changes")
    fits = {part.removesuffix("_s"): fit(rows, part, columns) for part in ("decode_s", "stage_s", "commit_s")}
    for r in rows:
        r["prepare_s"] = r["decode_s"] + r["stage_s"]
    fits["prepare"] = fit(rows, "prepare_s", columns)
    wide = _wide_decode(repeats, wide_numel)
    fits["decode_wide"] = fit(wide, "decode_s", ("tensors", "changes"))
    ops_per_destination = max(r["device_ops"] / r["destinations"] for r in rows)
    staged_per_change = statistics.median(r["staged_bytes"] / r["changes"] for r in rows)
    projection = node_projection(fits, ops_per_destination, staged_per_change)
    check = None
    if count_true:
        (check,) = _point(92, 160, (0.02,), repeats)
        check["prepare_s"] = check["decode_s"] + check["stage_s"]
        check["predicted"] = {
            part: predict(fits[part], check) for part in ("decode", "stage", "commit", "prepare")
        }
    return {
        "rows": rows,
        "wide_rows": wide,
        "fit": fits,
        "ops_per_destination": ops_per_destination,
        "count_true": check,
        "ops_per_sync_2pct": check["device_ops"] if check else None,
        "staged_bytes_per_change": staged_per_change,
        "per_tensor_us": fits["prepare"]["tensors"] * 1e6,
        "per_change_ns": (fits["prepare"]["changes"] + fits["commit"]["changes"]) * 1e9,
        "projected_node_sync_s_2pct": projection["node_s"],
        "projection": projection,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 14])
    ap.add_argument("--experts", type=int, nargs="+", default=[40, 160])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02, 0.1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--count-true", action="store_true", help="also GLM-4.7's 92 x 160 (44,189 tensors) at 2%%"
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    result = cost_model(a.layers, a.experts, tuple(a.densities), a.repeats, a.count_true)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
