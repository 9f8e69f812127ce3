"""The reader's decode on the host against the device decode (wire/batch_device.py) run on the CPU.

Why: both run the same torch ops (the host on the CPU, checked per batch); on an accelerator the
device decode's gain is in what crosses PCIe, counted here as bytes per change. Same changes as
docs/results/apply.md's reader check: 2 M changes in 24 [4096, 1024] bf16 params (2%). Decoded "on"
`meta` the device work costs nothing, so that row is the host's share of a device decode
(decompress, checks, the table): what an accelerator's host still pays per change.

    taskset -c 1 .venv/bin/python benchmarks/device_decode.py [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_delta.wire import DeltaWriter, iter_delta, open_delta
from vllm_delta.wire.batch_device import HOST, Decoder
from vllm_delta.wire.container import paused_gc


def write(
    path: Path, encoding: str, tensors: int = 24, shape: tuple[int, int] = (4096, 1024), density: float = 0.02
) -> None:
    gen = torch.Generator().manual_seed(0)
    numel = shape[0] * shape[1]
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding) as writer:
        for i in range(tensors):
            pos = torch.randperm(numel, generator=gen)[: int(numel * density)].sort().values
            old = torch.randn(pos.numel(), generator=gen).to(torch.bfloat16)
            writer.add(f"t{i}", pos, (old.view(torch.int16) + 1).view(torch.bfloat16), old, shape=shape)


def decode(path: Path, device: str | None) -> tuple[float, int, int]:
    """(seconds, changes, bytes sent to the device) of one decode of the whole delta (`device` None: the host's)."""
    info = open_delta(path)
    decoder = Decoder({p.name: torch.device(device) for p in info.manifest.params}) if device else HOST
    with paused_gc():
        start = time.perf_counter()
        changes = sum(
            d.count for d in iter_delta(info, current_version=0, lazy=True, decoder=decoder)
        )  # on meta: sizes
        decoder.verify()
        seconds = time.perf_counter() - start
    return seconds, changes, decoder.uploaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="device_decode_") as tmp:
        for encoding in ("ulp_zstd", "deltas_zstd", "planes_zstd"):
            path = Path(tmp) / encoding
            write(path, encoding)
            for device in (None, "cpu", "meta"):
                runs = [decode(path, device) for _ in range(args.repeats)]
                changes, sent = runs[0][1], runs[0][2]
                label = {
                    None: "host",
                    "cpu": "torch (device decode, on CPU)",
                    "meta": "device decode on meta: the host's share",
                }[device]
                rows.append(
                    {
                        "encoding": encoding,
                        "path": label,
                        "changes": changes,
                        "ns_per_change": 1e9 * statistics.median(r[0] for r in runs) / changes,
                        "samples_s": [r[0] for r in runs],
                        "h2d_bytes_per_change": sent / changes,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
