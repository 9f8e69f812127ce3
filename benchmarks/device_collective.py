"""device_check's `collective` section: the NCCL form of the collective transport, one flush at a time.

What the NCCL transport does per flush (vllm_delta/transports/groups.py): the trainer copies the
encoded flush into a pinned host buffer, then host-to-device on its own stream, and broadcasts it
with vLLM's PyNcclCommunicator; each engine rank receives it on its device and copies it to the host
(the decoder reads host bytes). Only one flush is in flight, so pinned and device memory stay at one
flush whatever the delta's size.

Why one process, not a two-rank NCCL broadcast: the device check gets one GPU, and NCCL refuses two
ranks on the same device ("Duplicate GPU detected", ncclInvalidUsage), so a same-GPU broadcast is not
a valid measurement; the device machine also has no vLLM (no PyNcclCommunicator). What is measured
is what the GPU adds around the broadcast: the pinned H2D stream of the real encoded flushes of a
delta, the D2H on the receiving side, and that the bytes come back bit-exact. On two GPUs the
broadcast itself moves those bytes over NVLink/PCIe between them (not measured here).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def section_collective(
    args: argparse.Namespace,
    ctx: dict,
    *,
    make_weights: Callable,
    step: Callable,
    write_delta: Callable,
    density: float = 0.02,
) -> dict:
    """Stream the flushes of one real delta through pinned host memory to the device and back."""
    cuda = args.device.startswith("cuda")
    old = make_weights()
    new = step(old, density, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v000001"
        write_delta(path, old, new, version=1)
        flushes = [f.read_bytes() for f in sorted(path.glob("rank*_flush*.safetensors"))]
    del old, new
    stream = torch.cuda.Stream() if cuda else None
    largest = max(len(f) for f in flushes)
    pinned = torch.empty(largest, dtype=torch.uint8, pin_memory=cuda)  # the one-flush window
    h2d_s = d2h_s = 0.0
    exact = True
    for data in flushes:
        n = len(data)
        host = pinned[:n]
        host.numpy()[:] = memoryview(data)
        start = time.perf_counter()
        if cuda:
            with torch.cuda.stream(stream):
                dev = host.to(args.device, non_blocking=True)
            stream.synchronize()
        else:
            dev = host.clone()
        h2d_s += time.perf_counter() - start
        start = time.perf_counter()
        back = dev.cpu().numpy().tobytes()
        d2h_s += time.perf_counter() - start
        exact &= back == data
        del dev
    total = sum(len(f) for f in flushes)
    return {
        "density": density,
        "flushes": len(flushes),
        "wire_bytes": total,
        "largest_flush": largest,
        "pinned_window_bytes": pinned.numel(),
        "h2d_s": h2d_s,
        "d2h_s": d2h_s,
        "h2d_gbps": total / max(h2d_s, 1e-9) / 1e9,
        "d2h_gbps": total / max(d2h_s, 1e-9) / 1e9,
        "exact": exact,
        "pinned": cuda,
        "ok": exact and len(flushes) > 0,
    }


def collective_markdown(c: dict) -> list[str]:
    return [
        "## collective (NCCL form, one process: see benchmarks/device_collective.py)",
        "",
        "| density | flushes | wire MB | largest flush MB | H2D GB/s | D2H GB/s | pinned | bit-exact |",
        "|---|---|---|---|---|---|---|---|",
        f"| {c['density']:.1%} | {c['flushes']} | {c['wire_bytes'] / 1e6:.2f} | {c['largest_flush'] / 1e6:.2f} | "
        f"{c['h2d_gbps']:.2f} | {c['d2h_gbps']:.2f} | {c['pinned']} | {c['exact']} |",
    ]
