"""The fuzzers' seed corpus, made by our own writer: every encoding, block-indexed and not.

Why the writer's output: a coverage-guided fuzzer mutates what it is given, so starting from real
flushes and manifests puts it past the container and the JSON at once, into the decoders. One small
model and one change set for every flush, so a single manifest template (`fuzz_harnesses.MANIFEST`)
describes them all; what varies is the encoding and the format.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from vllm_delta.wire import ENCODINGS, DeltaWriter
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import Limits
from vllm_delta.wire.flush import open_flush

SMALL_BLOCKS = Policy(span_bits=6, min_entries=8, max_entries=64)  # several blocks a param
HARNESSES = ("manifest", "flush", "params", "gaps", "seed")


def model() -> dict[str, torch.Tensor]:
    """A few bf16 matrices, a float32 vector, one bigger bf16 matrix: gaps of 1-8 bytes, escapes."""
    g = torch.Generator().manual_seed(33)
    out = {f"e{i}": torch.randn(16, 32, generator=g).bfloat16() for i in range(3)}
    out["norm"] = torch.randn(64, generator=g)
    out["big"] = torch.randn(64, 64, generator=g).bfloat16()
    return out


def changes(old: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per param (positions, new, old): steps of 1-3 ULP; `norm` changed whole (dense), `e0` sparse."""
    g = torch.Generator().manual_seed(34)
    out = {}
    for name, t in old.items():
        flat = t.reshape(-1)
        view = {2: torch.int16, 4: torch.int32}[t.element_size()]
        density = {"norm": 1.0, "e0": 0.01}.get(name, 0.2)
        hit = torch.rand(flat.shape, generator=g) < density
        hit[0] = True
        pos = torch.nonzero(hit).squeeze(1)
        step = torch.randint(1, 4, pos.shape, generator=g, dtype=view)
        new = (flat[pos].view(view) + step).view(t.dtype)
        out[name] = (pos, new, flat[pos])
    return out


def write(path: Path, encoding: str, blocked: bool) -> Path:
    old = model()
    with DeltaWriter(
        path, version=1, base_version=0, encoding=encoding, blocked=blocked, block_policy=SMALL_BLOCKS
    ) as w:
        for name, (pos, new, prev) in changes(old).items():
            w.add(name, pos, new, prev, shape=tuple(old[name].shape))
    return path


def flush_input(encoding: str, flags: int, decoded: int, data: bytes) -> bytes:
    """A flush harness input: a flags byte (encoding index, owned ranges), the manifest's decoded
    bytes (3 bytes), then the flush file."""
    return bytes([list(ENCODINGS).index(encoding) | flags]) + decoded.to_bytes(3, "little") + data


def seeds() -> dict[str, list[bytes]]:
    """Per harness its seed inputs."""
    out: dict[str, list[bytes]] = {h: [] for h in HARNESSES}
    with tempfile.TemporaryDirectory() as tmp:
        for encoding in ENCODINGS:
            for blocked in (True, False):
                d = write(Path(tmp) / f"{encoding}-{blocked}", encoding, blocked)
                text = (d / "manifest.json").read_bytes()
                out["manifest"].append(text)
                (entry,) = json.loads(text)["files"]
                data = (d / entry["name"]).read_bytes()
                for flags in (0, 8):
                    out["flush"].append(flush_input(encoding, flags, entry["decoded_bytes"], data))
                if blocked:
                    _, meta, _ = open_flush(data, file="f", limits=Limits())
                    out["params"].append(meta["params"].encode())
    for width in (1, 2, 4, 8):
        out["gaps"].append(bytes([width, 200]) + bytes(range(64)) * width)
    out["seed"].extend(seed_files())
    return out


def seed_files() -> list[bytes]:
    """Flush files in the seed's own (manifest-less) format, as tests/wire/test_seed.py writes them."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "wire"))
    from wire_helpers import seed_flush_bytes  # tests/wire: the seed layout's test-side writer

    old = model()
    out = []
    for encoding in ("indices", "deltas", "deltas_zstd"):
        picked = [(n, old[n], _applied(old[n], c)) for n, c in changes(old).items() if n in ("e0", "norm")]
        out.append(seed_flush_bytes(picked, encoding=encoding, version=1))
    return out


def _applied(t: torch.Tensor, change) -> torch.Tensor:
    pos, new, _ = change
    out = t.clone()
    out.view(-1)[pos] = new
    return out


def write_corpus(root: Path) -> dict[str, Path]:
    """The seed corpus on disk, a directory per harness (as atheris/libFuzzer reads one)."""
    dirs = {}
    for harness, inputs in seeds().items():
        d = dirs[harness] = root / harness
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(inputs):
            (d / f"seed{i:03d}").write_bytes(data)
    return dirs
