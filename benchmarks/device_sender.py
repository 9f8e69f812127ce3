"""The `sender` section of benchmarks/device_check.py: the producer's scan on device tensors.

Why: the sender's diff, gather, digests and staging are meant to run where the parameters live,
with only O(changed) bytes crossing to the host. This times `Producer.scan` with the snapshot on
the device and in pinned host memory against a device memcpy of the same bytes, and checks every
staged change against the positions the step really moved (known here, not re-derived by a diff).
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm_delta.sender import Shard
from vllm_delta.sender.producer import Producer
from vllm_delta.wire.additive import tensor_sum, to_hex


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _move(weights: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """±1 ULP at a random `density` of each tensor's elements, in place; returns the positions moved."""
    gen = torch.Generator(device=next(iter(weights.values())).device).manual_seed(seed)
    moved = {}
    for name, t in weights.items():
        flat = t.view(-1).view(torch.int16)
        k = max(1, int(flat.numel() * density))
        idx = torch.randint(0, flat.numel(), (k,), generator=gen, device=flat.device).unique()
        flat[idx] += torch.where(torch.rand(idx.numel(), generator=gen, device=flat.device) < 0.5, 1, -1).to(
            torch.int16
        )
        moved[name] = idx
    return moved


def section_sender(
    args: argparse.Namespace, ctx: dict, *, shapes: dict[str, tuple[int, ...]], make_weights
) -> dict:
    device = args.device
    weights = make_weights()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    memcpy_s = min(_timed(device, lambda: [dst[n].copy_(t) for n, t in weights.items()])[1] for _ in range(3))
    del dst
    shards = [Shard.whole(n, t) for n, t in weights.items()]
    rows = []
    for place in ("device", "host"):
        producer = Producer(snapshot=place)
        _, seed_s = _timed(device, lambda: producer.seed(shards))
        for version, density in enumerate(args.densities, start=1):
            if time.perf_counter() - ctx["start"] > args.max_s:
                rows.append({"snapshot": place, "density": density, "skipped": f"over --max-s {args.max_s}"})
                continue
            before = {n: t.clone() for n, t in weights.items()}
            moved = _move(weights, density, seed=version)
            cap, scan_s = _timed(device, lambda: producer.scan(shards, kind="delta", anchor=False))
            wrong = []
            for e in cap.entries:
                want = moved[e.name].cpu()
                cur, old = weights[e.name].view(-1), before[e.name].view(-1)
                ok = (
                    torch.equal(e.positions, want)
                    and torch.equal(
                        e.new_values.view(torch.int16), cur[moved[e.name]].cpu().view(torch.int16)
                    )
                    and torch.equal(
                        e.old_values.view(torch.int16), old[moved[e.name]].cpu().view(torch.int16)
                    )
                    and to_hex(e.digests["digest"]) == to_hex(tensor_sum(weights[e.name]))
                )
                if not ok or e.positions.device.type != "cpu":
                    wrong.append(e.name)
            staged = sum(e.positions.nbytes + e.new_values.nbytes + e.old_values.nbytes for e in cap.entries)
            rows.append(
                {
                    "snapshot": place,
                    "density": density,
                    "changed": cap.changed,
                    "scan_s": scan_s,
                    "scan_gbps": nbytes / scan_s / 1e9,
                    "x_memcpy": scan_s / memcpy_s,
                    "staged_bytes": staged,
                    "seed_s": seed_s,
                    "exact": not wrong,
                    "wrong": wrong[:10],
                }
            )
            for n, t in weights.items():  # back to the snapshot's state for the next density
                t.copy_(before[n])
        del producer
    return {
        "model_bytes": nbytes,
        "memcpy_s": memcpy_s,
        "rows": rows,
        "ok": all(r.get("exact", True) for r in rows) and any("exact" in r for r in rows),
    }


def sender_markdown(s: dict) -> list[str]:
    lines = [
        f"## sender: `Producer.scan` over {s['model_bytes'] / 1e9:.2f} GB of bf16 weights "
        f"(device memcpy of the same bytes: {s['memcpy_s']:.3f} s)",
        "",
        "| snapshot | density | changed | scan s | GB/s scanned | × memcpy | staged MB | exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['snapshot']} | {r['density']:.1%} | skipped: {r['skipped']} |")
            continue
        lines.append(
            f"| {r['snapshot']} | {r['density']:.1%} | {r['changed']:,} | {r['scan_s']:.3f} | "
            f"{r['scan_gbps']:.1f} | {r['x_memcpy']:.1f} | {r['staged_bytes'] / 1e6:.1f} | {r['exact']} |"
        )
    lines += [
        "",
        "scan: bitwise diff against the snapshot, gather of new and old values, additive digests, "
        "and the pinned host copies of the changes (waited for). exact: staged positions, values and "
        "whole-tensor digest equal the positions the step moved, read back independently.",
    ]
    return lines


def section_bucket_scan(args: argparse.Namespace, ctx: dict) -> dict:
    """The one-pass scan (`sender/bucket_scan.py`) over one contiguous bf16 bucket shaped like a
    ParamAndGradBuffer (params as views, padding between them): GB/s against a device memcpy of the
    bucket, torch ops per sync (on the CPU they also grow with the changes: digests are summed in
    cache-sized slices), and every staged change checked against the positions moved."""
    from torch.utils._python_dispatch import TorchDispatchMode

    device = args.device
    numel = int(args.scan_gb * 1e9 / 2) if device.startswith("cuda") else 1 << 22
    n_params, pad = 64, 64
    size = (numel // n_params) & ~127
    buf = torch.zeros(n_params * (size + pad), dtype=torch.bfloat16, device=device)
    buf.normal_(0, 0.02)
    weights = {
        f"p{k}": buf[k * (size + pad) : k * (size + pad) + size].view(size // 128, 128)
        for k in range(n_params)
    }
    shards = [Shard.whole(n, t) for n, t in weights.items()]
    dst = torch.empty_like(buf)
    memcpy_s = min(_timed(device, lambda: dst.copy_(buf))[1] for _ in range(3))
    del dst
    rows = []
    for place in ("device", "host"):
        producer = Producer(snapshot=place, post_hash=False)
        producer.seed([s.with_tensor(s.tensor.clone()) for s in shards])
        for version, density in enumerate(args.densities, start=1):
            before = buf.clone()
            moved = _move(weights, density, seed=version)
            cap, scan_s = _timed(device, lambda: producer.scan(shards, kind="delta", anchor=False))
            wrong = [
                e.name
                for e in cap.entries
                if not (
                    torch.equal(e.positions, moved[e.name].cpu())
                    and torch.equal(
                        e.new_values.view(torch.int16),
                        weights[e.name].view(-1)[moved[e.name]].cpu().view(torch.int16),
                    )
                    and to_hex(e.digests["digest"]) == to_hex(tensor_sum(weights[e.name]))
                )
            ]

            class Count(TorchDispatchMode):
                n = 0

                def __torch_dispatch__(self, func, types, a=(), kw=None):
                    Count.n += 1
                    return func(*a, **(kw or {}))

            with Count():
                producer.scan(shards, kind="delta", anchor=False)
            rows.append(
                {
                    "snapshot": place,
                    "density": density,
                    "changed": cap.changed,
                    "scan_s": scan_s,
                    "scan_gbps": buf.numel() * 2 / scan_s / 1e9,
                    "x_memcpy": scan_s / memcpy_s,
                    "ops_per_sync": Count.n,
                    "buckets": len(cap.buckets),
                    "exact": not wrong,
                    "wrong": wrong[:10],
                }
            )
            buf.copy_(before)  # nothing advanced: the next density starts from the snapshot again
        del producer
    return {
        "bucket_bytes": buf.numel() * 2,
        "params": n_params,
        "memcpy_s": memcpy_s,
        "rows": rows,
        "ok": all(r["exact"] and r["buckets"] == 1 for r in rows),
    }


def bucket_scan_markdown(s: dict) -> list[str]:
    lines = [
        f"## bucket_scan: one pass over one {s['bucket_bytes'] / 1e9:.2f} GB bf16 bucket of {s['params']} "
        f"params (device memcpy of the bucket: {s['memcpy_s']:.4f} s, "
        f"{s['bucket_bytes'] / s['memcpy_s'] / 1e9:.0f} GB/s)",
        "",
        "| snapshot | density | changed | scan s | GB/s scanned | × memcpy | ops per sync | exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['snapshot']} | {r['density']:.1%} | {r['changed']:,} | {r['scan_s']:.4f} | {r['scan_gbps']:.1f} "
        f"| {r['x_memcpy']:.1f} | {r['ops_per_sync']} | {r['exact']} |"
        for r in s["rows"]
    ]
    return lines
