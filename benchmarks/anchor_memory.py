"""What an anchor costs in host memory: bytes the capture stages per element, and the peak RSS the
publisher's anchor encode adds (docs/results/sender.md, "Anchors").

Why: an anchor re-sends every element. It used to stage an int64 position and a value copy per
element at capture (~10 B per bf16 element, 52-63 GB per GPU at 355B); it now reads the snapshot
piece by piece as it is encoded. Runs the real Producer and the publisher's own `_add` on CPU
tensors, so the same script measures any revision (`PYTHONPATH=<checkout> python ...`).

    python benchmarks/anchor_memory.py --elements 64000000 --flush-mib 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vllm_delta.sender import Shard
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.publisher import _add
from vllm_delta.wire import FlushBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness.capture_bytes import staged_bytes  # noqa: E402


def rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=64_000_000)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--flush-mib", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    per = args.elements // args.tensors
    live = [(torch.randn(per, generator=g) * 0.02).to(torch.bfloat16) for _ in range(args.tensors)]
    shards = [Shard.whole(f"w{i}", t) for i, t in enumerate(live)]
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed(shards)
    for t in live:
        t.view(torch.int16)[torch.randint(0, per, (int(per * args.density),), generator=g)] += 1
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    base = rss("VmRSS")
    cap = producer.scan(shards, kind="", anchor=True)
    scan_peak = rss("VmHWM") - base
    staged = staged_bytes(cap, producer, live)
    b = FlushBuilder(
        lambda name, f: None, version=1, encoding="planes_zstd", flush_bytes=args.flush_mib << 20
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")
    start = time.perf_counter()
    for e in cap.entries:
        _add(b, e, "anchor")
    b.manifest()
    encode_s = time.perf_counter() - start
    n = sum(t.numel() for t in live)
    print(
        json.dumps(
            {
                "elements": n,
                "changed": cap.changed,
                "flush_bytes": args.flush_mib << 20,
                "flushes": len(b.files),
                "staged_bytes": staged,
                "staged_bytes_per_element": round(staged / n, 4),
                "scan_peak_rss_bytes": scan_peak,
                "encode_peak_rss_over_capture_bytes": rss("VmHWM") - before,
                "capture_held_bytes_after_encode": staged,
                "encode_s": round(encode_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
