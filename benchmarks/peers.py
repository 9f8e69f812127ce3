"""Side by side with vLLM 0.32's own sparse backend, `sparse_nccl`, on the same model and delta.

What `sparse_nccl` is (vllm/distributed/weight_transfer/sparse_nccl_engine.py): per changed tensor,
int32 flat indices and the values in the tensor's dtype, broadcast over NCCL, with names, dtypes,
shapes and counts in the HTTP `update_info`; the worker applies them with
`load_checkpoint_weight_patches` (NaN-filled full-shape tensors through the model's
`load_weights`, `Tensor.copy_` patched), all inside the update RPC. vLLM 0.32 ships no disk form.

Measured here, one in-process CPU engine with delta updates on, a random-weight Llama
(benchmarks/apply.py's model and perturb-style deltas), per density:

- bytes per changed element: ours, the flush files and manifest on disk per encoding; theirs, the
  broadcast tensors (int32 indices + values) and the `update_info` JSON, built from the same delta
  and checked by the sender's own `_validate_patch`;
- apply time, pause and staging memory: ours as the route runs it (`_apply_worker.ours`: prepare
  while serving, then the commit, the pause); theirs `load_checkpoint_weight_patches` as
  `receive_weights` calls it (`_peers_worker.sparse_nccl_apply`), the whole of it inside the pause;
- exactness: after each method's forward apply at `--check-density`, the engine's weights against
  the new checkpoint (`_apply_worker.matches_checkpoint`).

The NCCL broadcast itself cannot run on this CPU (PyNcclCommunicator needs CUDA): its time is not
measured. Three samples per method and density (BASE -> NEW, NEW -> BASE, BASE -> NEW), median.

    .venv/bin/python benchmarks/peers.py [--layers 4] [--densities 0.005 0.02] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks import _apply_worker as W  # noqa: E402
from benchmarks import _peers_worker as P  # noqa: E402
from benchmarks.apply import (  # noqa: E402
    CHUNK_BYTES,
    dir_bytes,
    llama_config,
    make_base,
    make_deltas,
    other_engines,
    rpc,
    write_model,
)
from vllm_delta.wire import tensor_digest  # noqa: E402
from vllm_delta.wire.manifest import MANIFEST_NAME  # noqa: E402

MB = 1e6


def sparse_nccl_wire(path: Path) -> dict[str, int]:
    """What `SparseNCCLTrainerWeightTransferEngine.send_weight_chunk` moves for this delta."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseNCCLWeightTransferUpdateInfo,
        SparseWeightPatch,
    )

    patches = [
        SparseWeightPatch(p.name, p.indices.to(torch.int32), p.values, tuple(p.shape))
        for p in W._decoded_patches(str(path))
    ]
    for patch in patches:
        SparseNCCLTrainerWeightTransferEngine._validate_patch(patch)
    info = SparseNCCLWeightTransferUpdateInfo(
        names=[p.name for p in patches],
        dtype_names=[str(p.values.dtype).split(".")[-1] for p in patches],
        shapes=[list(p.full_shape) for p in patches],
        num_updates_list=[p.indices.numel() for p in patches],
    )
    return {
        "changed": sum(p.indices.numel() for p in patches),
        "broadcast": sum(p.indices.nbytes + p.values.nbytes for p in patches),
        "http": len(json.dumps({"update_info": asdict(info)})),
    }


def ours_wire(path: Path) -> int:
    return dir_bytes(path) + (path / MANIFEST_NAME).stat().st_size


def run(a: argparse.Namespace, work: Path) -> dict:
    from harness.vllm_engine import start_llm

    cfg = llama_config(a)
    base = make_base(cfg)
    res: dict = {"params": sum(t.numel() for t in base.values()), "tensors": len(base), "densities": {}}
    base_dir, new_dir = work / "base", work / "new"
    write_model(cfg, base_dir, base)
    digests = {n: tensor_digest(t) for n, t in base.items()}
    deltas = {}
    for d in a.densities:
        deltas[d], changed = make_deltas(
            base, digests, d, work, a.encodings, new_dir if d == a.check_density else None, cfg
        )
        row = res["densities"][d] = {"changed": changed, "bytes": {}}
        for enc in a.encodings:
            row["bytes"][enc] = ours_wire(deltas[d][f"{enc}_fwd"])
        row["sparse_nccl"] = sparse_nccl_wire(deltas[d]["deltas_zstd_fwd"])  # overwrite values: its input
        print(f"deltas at {d:.1%}: {changed} changed; bytes {row['bytes']}, sparse_nccl {row['sparse_nccl']}")
    del base
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    res["other_engines"], res["load_before"] = other_engines(), os.getloadavg()
    with start_llm(base_dir, delta=True) as llm:
        rpc(llm, W.learn_placement)
        enc = a.encoding
        for d in sorted(deltas):
            fwd, rev = str(deltas[d][f"{enc}_fwd"]), str(deltas[d][f"{enc}_rev"])
            # The same changes with overwrite values (vLLM's loader takes no base-relative steps).
            sfwd, srev = str(deltas[d]["deltas_zstd_fwd"]), str(deltas[d]["deltas_zstd_rev"])
            row = res["densities"][d]
            rpc(llm, W.ours, fwd, 1, CHUNK_BYTES)  # warm-up, unscored
            rpc(llm, W.ours, rev, 2, CHUNK_BYTES)
            row["ours"], row["sparse"] = [], []
            for path, version in ((fwd, 1), (rev, 2), (fwd, 1)):
                row["ours"].append(rpc(llm, W.ours, path, version, CHUNK_BYTES))
                if d == a.check_density and version == 1 and "ours_exact" not in row:
                    row["ours_exact"] = rpc(llm, W.matches_checkpoint, str(new_dir))
            rpc(llm, W.ours, rev, 2, CHUNK_BYTES)  # back on BASE
            rpc(llm, P.sparse_nccl_apply, sfwd)  # warm-up, unscored
            rpc(llm, P.sparse_nccl_apply, srev)
            for path in (sfwd, srev, sfwd):
                row["sparse"].append(rpc(llm, P.sparse_nccl_apply, path))
                if d == a.check_density and path == sfwd and "sparse_exact" not in row:
                    row["sparse_exact"] = rpc(llm, W.matches_checkpoint, str(new_dir))
            rpc(llm, P.sparse_nccl_apply, srev)  # back on BASE
            print(
                f"{d:.1%}: ours {med(row['ours'], 'total_s'):.3f}s, sparse {med(row['sparse'], 'total_s'):.3f}s"
            )
    res["load_after"] = os.getloadavg()
    return res


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(res: dict, a: argparse.Namespace) -> list[str]:
    enc = a.encoding
    lines = [
        f"Model: random-weight Llama, {res['params'] / 1e6:.0f} M params (bf16), {res['tensors']} tensors; "
        f"`--layers {a.layers} --hidden {a.hidden} --intermediate {a.intermediate}`. Our apply reads `{enc}`. "
        f"Load average before/after: {res['load_before'][0]:.1f}/{res['load_after'][0]:.1f}; "
        f"other vLLM engines running: {res['other_engines']}.",
        "",
        "| density | changed | ours "
        + " | ours ".join(a.encodings)
        + " | sparse_nccl (broadcast + update_info) |",
        "|---|---|" + "---|" * len(a.encodings) + "---|",
    ]
    for d, row in sorted(res["densities"].items()):
        n, s = row["changed"], row["sparse_nccl"]
        cells = [f"{row['bytes'][e] / n:.2f} B" for e in a.encodings]
        lines.append(
            f"| {d:.1%} | {n:,} | " + " | ".join(cells) + f" | {(s['broadcast'] + s['http']) / n:.2f} B "
            f"({s['broadcast'] / n:.2f} + {s['http'] / n:.3f}) |"
        )
    lines += [
        "",
        "Bytes per changed element (flush files + manifest for ours; what the sender moves for sparse_nccl).",
        "",
        "| density | ours: prepare (serving) | ours: commit (pause) | ours: staged | ours: peak extra "
        "| sparse_nccl: apply (= pause) | sparse_nccl: peak extra | +post-load (not in sparse_nccl) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, row in sorted(res["densities"].items()):
        o, s = row["ours"], row["sparse"]
        lines.append(
            f"| {d:.1%} | {med(o, 'prepare_s'):.3f} s | {med(o, 'commit_s'):.3f} s | {med(o, 'staged') / MB:.1f} MB "
            f"| {med(o, 'extra') / MB:.1f} MB | {med(s, 'total_s'):.3f} s | {med(s, 'extra') / MB:.1f} MB "
            f"| {med(s, 'post_load_s'):.3f} s |"
        )
    for d, row in sorted(res["densities"].items()):
        if "ours_exact" in row:
            lines += [
                "",
                f"Exact at {d:.1%} against the new checkpoint: ours mismatched {row['ours_exact']['mismatched']}, "
                f"sparse_nccl mismatched {row['sparse_exact']['mismatched']}.",
            ]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02, 0.05])
    p.add_argument("--check-density", type=float, default=0.02)
    p.add_argument("--encoding", default="ulp_zstd", help="the encoding our apply reads")
    p.add_argument("--encodings", nargs="+", default=["ulp_zstd", "deltas_zstd", "indices"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    a = p.parse_args()
    if (
        a.encoding not in a.encodings
        or "deltas_zstd" not in a.encodings
        or a.check_density not in a.densities
    ):
        p.error("--encodings must hold --encoding and deltas_zstd, --densities --check-density")
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="peers-bench-"))
    try:
        res = run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - start
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "peers.json").write_text(json.dumps(res, indent=1, default=str))
    print("\n".join(report(res, a)))


if __name__ == "__main__":
    main()
