"""Block-fp8 deltas from a bf16 trainer (issue 32): bytes per changed bf16 element and fp8 change densities.

For each size and bf16 density (1%, 2%, 5%), three seeds: a bf16 weight (std 0.02) is quantized by the
sender's block-fp8 stage (`sender/fp8_quant.py`, bit-equal to vLLM's `per_block_cast_to_fp8`:
tests/sender/test_fp8_sender.py), a `density` fraction of its elements moves (an AdamW-like step: each
moved element by 1-3 bf16 ULPs, either sign), and the sender's own scan and encoder (`Producer.scan`,
the publisher's `_add` into a `FlushBuilder`, the default `ulp_zstd`) give the delta's bytes. Reported:
the fp8 codes and `weight_scale_inv` values that changed, the blocks re-quantized, the delta's bytes per
changed bf16 element against a full fp8 sync (every code plus every scale, uncompressed), and the same
step sent as a bf16 delta. Item 4: the same weights quantized per tensor and per output channel (vLLM's
online `--quantization fp8` scales), and how many codes a step changes there.

Run pinned: taskset -c 1 .venv/bin/python benchmarks/fp8_bytes.py  (writes docs/results/fp8.json, fp8.png)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_delta.sender import Shard  # noqa: E402
from vllm_delta.sender.fp8_quant import FP8, FP8_MAX, BlockFp8Quantizer, BlockFp8Spec  # noqa: E402
from vllm_delta.sender.producer import Producer  # noqa: E402
from vllm_delta.sender.publisher import _add  # noqa: E402
from vllm_delta.wire import FlushBuilder  # noqa: E402

SIZES = {"tiny": (1024, 2048), "medium": (4096, 8192)}
DENSITIES = (0.01, 0.02, 0.05)
SEEDS = (0, 1, 2)


def step(w: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """`w` with `density` of its elements moved by 1-3 bf16 ULPs, either sign (never across zero's sign)."""
    bits = w.clone().reshape(-1).view(torch.int16)
    k = int(bits.numel() * density)
    pos = torch.randperm(bits.numel(), generator=gen)[:k]
    move = torch.randint(1, 4, (k,), generator=gen, dtype=torch.int16)
    bits[pos] += torch.where(torch.rand(k, generator=gen) < 0.5, move, -move)
    return bits.view(torch.bfloat16).reshape(w.shape)


def wire_bytes(producer: Producer, shards: list[Shard]) -> int:
    cap = producer.scan(shards, kind="delta", anchor=False)
    b = FlushBuilder(
        lambda name, f: None, version=1, base_version=0, encoding="ulp_zstd", flush_bytes=1 << 30
    )
    for e in cap.entries:
        _add(b, e, "delta")
    b.manifest()
    producer.advance(cap)
    return b.wire_bytes


def coarse(w: torch.Tensor, dim: tuple[int, ...] | None) -> torch.Tensor:
    """Codes under one scale per tensor (`dim` None) or per output row, vLLM's online fp8 arithmetic."""
    amax = w.abs().float().amax() if dim is None else w.abs().float().amax(dim=dim, keepdim=True)
    return (w.float() / (amax.clamp(1e-12) / FP8_MAX)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def one(shape: tuple[int, int], density: float, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    q = BlockFp8Quantizer(BlockFp8Spec((128, 128), ()), ["w"])
    fp8, bf16 = Producer(snapshot="host"), Producer(snapshot="host")
    out0 = q.apply([Shard.whole("w", w0)])
    codes0, scales0 = (s.tensor.clone() for s in out0)
    fp8.seed([s.with_tensor(s.tensor.clone()) for s in out0])
    bf16.seed([Shard.whole("w", w0.clone())])
    blocks0 = q.blocks_requantized
    w1 = step(w0, density, gen)
    out1 = q.apply([Shard.whole("w", w1)])
    codes1, scales1 = (s.tensor for s in out1)
    n, nblocks = w0.numel(), scales0.numel()
    changed = int((w1.view(torch.int16) != w0.view(torch.int16)).sum())
    fp8_wire = wire_bytes(fp8, out1)
    per_tensor = coarse(w1, None).view(torch.uint8) != coarse(w0, None).view(torch.uint8)
    per_row = coarse(w1, (1,)).view(torch.uint8) != coarse(w0, (1,)).view(torch.uint8)
    moved = w1.clone().reshape(-1)  # the same step, and the tensor's extreme one bf16 ULP further out
    top = int(w0.reshape(-1).float().abs().argmax())
    moved.view(torch.int16)[top] = w0.reshape(-1).view(torch.int16)[top] + 1
    per_tensor_moved = coarse(moved.reshape(shape), None).view(torch.uint8) != coarse(w0, None).view(
        torch.uint8
    )
    return {
        "bf16_changed": changed,
        "code_density": int((codes1.view(torch.uint8) != codes0.view(torch.uint8)).sum()) / n,
        "scale_density": int((scales1.view(torch.int32) != scales0.view(torch.int32)).sum()) / nblocks,
        "blocks_requantized": (q.blocks_requantized - blocks0) / nblocks,
        "fp8_wire_bytes": fp8_wire,
        "bytes_per_changed": fp8_wire / changed,
        "full_fp8_bytes": n + 4 * nblocks,
        "full_fp8_per_changed": (n + 4 * nblocks) / changed,
        "bf16_bytes_per_changed": wire_bytes(bf16, [Shard.whole("w", w1)]) / changed,
        "per_tensor_code_density": int(per_tensor.sum()) / n,
        "per_row_code_density": int(per_row.sum()) / n,
        "per_tensor_scale_moved_code_density": int(per_tensor_moved.sum()) / n,
    }


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    for size, shape in SIZES.items():
        for d in DENSITIES:
            runs = [one(shape, d, s) for s in SEEDS]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            results[f"{size} {d:.0%}"] = {"shape": list(shape), "density": d, **med}
            print(
                f"{size:6s} {d:4.0%}: codes {med['code_density']:.2%} scales {med['scale_density']:.2%} "
                f"blocks {med['blocks_requantized']:.0%} | {med['bytes_per_changed']:.2f} B/changed "
                f"(full fp8 {med['full_fp8_per_changed']:.1f}, bf16 delta {med['bf16_bytes_per_changed']:.2f}) "
                f"| per-tensor codes {med['per_tensor_code_density']:.2%} "
                f"({med['per_tensor_scale_moved_code_density']:.2%} if its scale moves), "
                f"per-row {med['per_row_code_density']:.2%}",
                flush=True,
            )
    out = ROOT / "docs" / "results"
    (out / "fp8.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "fp8.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for size in SIZES:
        rows = [r for r in results.values() if r["shape"] == list(SIZES[size])]
        x = [100 * r["density"] for r in rows]
        a.plot(x, [r["bytes_per_changed"] for r in rows], "o-", label=f"block-fp8 delta ({size})")
        a.plot(x, [r["full_fp8_per_changed"] for r in rows], "s--", label=f"full fp8 sync ({size})")
        a.plot(
            x, [r["bf16_bytes_per_changed"] for r in rows], "x:", label=f"the step as a bf16 delta ({size})"
        )
        b.plot(x, [100 * r["code_density"] for r in rows], "o-", label=f"fp8 codes ({size})")
        b.plot(x, [100 * r["scale_density"] for r in rows], "^-", label=f"block scales ({size})")
    x = [100 * d for d in DENSITIES]
    b.plot(x, x, "k:", label="bf16 elements")
    a.set(xlabel="bf16 elements changed (%)", ylabel="bytes per changed bf16 element", yscale="log")
    b.set(xlabel="bf16 elements changed (%)", ylabel="changed (%)", yscale="log")
    a.set_title("bytes on the wire")
    b.set_title("fp8 change density")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
