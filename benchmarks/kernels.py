"""Does each compiled kernel still pay? Each entry point timed with the kernels on and off
(`VLLM_DELTA_KERNELS`, the numpy/torch reference), interleaved, on one torch thread, at a 64 Mi-element
bf16 storage with 2% changed. Prints one line per kernel: the medians of `--repeats` and their ratio.
The sender's fused scan has its own A/B in `benchmarks/sender.py --p3-only`. Results: docs/results/kernels.md.

    taskset -c 0 python benchmarks/kernels.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from vllm_delta.engine.commit import read_back, scatter
from vllm_delta.engine.staging import Chunk
from vllm_delta.kernels import digest
from vllm_delta.wire import codecs
from vllm_delta.wire.dtypes import by_name


def cases(elements: int, density: float) -> dict:
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    n = int(elements * density)
    pos = np.sort(rng.choice(elements, n, replace=False)).astype(np.int64)
    _, gaps = codecs.encode_gaps(pos)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = (old.astype(np.int64) + rng.integers(-2, 3, n)).astype(np.uint16)
    flat = torch.randn(elements, generator=g).bfloat16()
    offsets, positions = torch.from_numpy(pos.astype(np.int32)), torch.from_numpy(pos)
    values = torch.randn(n, generator=g).bfloat16()
    steps = torch.from_numpy(rng.integers(-2, 3, n).astype(np.int16))
    seg = torch.zeros(n, dtype=torch.int64)
    bf = by_name("bfloat16")
    return {
        "decode_gaps": lambda: codecs.decode_gaps(gaps, elements, file=None, param=None),
        "gap_planes": lambda: codecs.to_planes(codecs.encode_gaps(pos)[1]),
        "ulp_streams": lambda: codecs.ulp_streams(new, old, bf),
        "scatter + read_back, values": lambda: read_back(
            flat, offsets, scatter(flat, Chunk(offsets, values))
        ),
        "scatter + read_back, ULP steps": lambda: read_back(
            flat, offsets, scatter(flat, Chunk(offsets, steps, torch.bfloat16))
        ),
        "segment_sums": lambda: digest.segment_sums(positions, values, seg, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 26)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, fn in cases(args.elements, args.density).items():
        times: dict[str, list[float]] = {"1": [], "0": []}
        for rep in range(args.repeats + 1):  # the first of each arm compiles / warms caches: not kept
            for arm in ("1", "0"):
                os.environ["VLLM_DELTA_KERNELS"] = arm
                start = time.perf_counter()
                fn()
                if rep:
                    times[arm].append(time.perf_counter() - start)
        k, r = statistics.median(times["1"]), statistics.median(times["0"])
        print(f"{name:32s} kernel {k * 1e3:8.1f} ms  reference {r * 1e3:8.1f} ms  {r / k:5.2f}x", flush=True)
    os.environ.pop("VLLM_DELTA_KERNELS")


if __name__ == "__main__":
    main()
