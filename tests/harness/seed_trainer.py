"""The seed's trainer side of a disk delta sync, as slime's delta sync and vime's port of it do it.

Why a test-side writer: our engine must take the seed's flushes and pushes unchanged. This writes
them the way the seed's trainer does (its `encode_indices`/`encode_deltas`, one flush per
bucket, `safetensors.torch.save` then zstd level 1 for `deltas_zstd`, `rank{R:04d}_flush{K:06d}`
under `weight_v{N:06d}`, one push per pass naming the files written since the last push). Its
output equals the seed's own encoder's, held by content digests that encoder produced
(tests/integrations/test_seed_flush_bytes.py): a safetensors file's header order is a hash map's,
so the bytes themselves differ from run to run, even the seed's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import requests
import torch
import zstandard
from safetensors.torch import save

Change = tuple[str, torch.Tensor, torch.Tensor]  # name, old, new (the trainer's snapshot and weights)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def encode(changes: Sequence[Change], encoding: str) -> tuple[bytes, list[torch.Tensor], list[dict]]:
    """Positions blob, value pieces and param entries of one chunk; unchanged tensors are left out."""
    blob, values, params = bytearray(), [], []
    val_off = 0
    for name, old, new in changes:
        int_dtype = _INT[new.element_size()]
        idx = (new.reshape(-1).view(int_dtype) != old.reshape(-1).view(int_dtype)).nonzero().view(-1)
        if not idx.numel():
            continue
        if encoding == "indices":
            width, packed = 4, idx.to(torch.int32).numpy().tobytes()
        else:  # gaps idx[k] - idx[k-1] - 1 with idx[-1] = -1; u16 unless a gap needs u32
            gaps = idx - torch.cat([torch.tensor([-1]), idx[:-1]]) - 1
            width = 2 if int(gaps.max()) <= 0xFFFF else 4
            packed = gaps.numpy().astype("<u2" if width == 2 else "<u4").tobytes()
        params.append(
            {
                "name": name,
                "dtype": str(new.dtype).removeprefix("torch."),
                "shape": list(new.shape),
                "pos_start": len(blob),
                "pos_end": len(blob) + len(packed),
                "pos_width": width,
                "val_start": val_off,
                "val_end": val_off + idx.numel(),
            }
        )
        blob += packed
        values.append(new.reshape(-1)[idx])
        val_off += idx.numel()
    return bytes(blob), values, params


def flush_bytes(chunks: Sequence[Sequence[Change]], *, encoding: str, version: int) -> bytes:
    """One flush of `chunks` (a bucket): values concatenated (mixed dtypes promote, as the seed's did)."""
    blob, values, params = bytearray(), [], []
    for chunk in chunks:
        pos, vals, entries = encode(chunk, encoding)
        if not entries:
            continue
        for p in entries:
            p.update(
                pos_start=p["pos_start"] + len(blob),
                pos_end=p["pos_end"] + len(blob),
                val_start=p["val_start"] + sum(v.numel() for v in values),
                val_end=p["val_end"] + sum(v.numel() for v in values),
            )
        blob += pos
        values += vals
        params += entries
    positions = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    )
    merged = torch.cat(values) if values else torch.empty(0, dtype=torch.bfloat16)
    checksum = int(torch.hash_tensor(positions).item()) if positions.numel() else 0
    checksum ^= (int(torch.hash_tensor(merged).item()) if merged.numel() else 0) << 1
    data = save(
        {"__positions__": positions, "__values__": merged},
        metadata={
            "encoding": encoding,
            "params": json.dumps(params),
            "current_version": str(version),
            "checksum": str(checksum),
        },
    )
    return zstandard.ZstdCompressor(level=1, threads=-1).compress(data) if encoding == "deltas_zstd" else data


def content_digest(data: bytes) -> str:
    """A flush's content, whatever order its header lists things in: metadata, tensor dtypes and bytes."""
    if data[:4] == b"\x28\xb5\x2f\xfd":
        data = zstandard.ZstdDecompressor().decompress(data)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    digest = hashlib.sha256(json.dumps(header.pop("__metadata__"), sort_keys=True).encode())
    for name in sorted(header):
        start, end = header[name]["data_offsets"]
        digest.update(f"{name}:{header[name]['dtype']}:{header[name]['shape']}".encode())
        digest.update(data[8 + n + start : 8 + n + end])
    return digest.hexdigest()


class SeedTrainer:
    """The seed's disk sync against one engine: `sync(passes)` writes version N's flushes, pushes
    after each pass, and bumps the engine's version through vLLM's route when nothing changed."""

    def __init__(
        self,
        url: str,
        delta_dir: Path,
        *,
        version: int = 0,
        encoding: str = "deltas_zstd",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url, self.delta_dir, self.version = url, delta_dir, version
        self.encoding, self.headers = encoding, headers or {}
        self.pushes: list[dict] = []  # each push's body, as sent
        delta_dir.mkdir(parents=True, exist_ok=True)

    def sync(self, passes: Sequence[Sequence[Sequence[Change]]]) -> list[requests.Response]:
        """`passes`: each pass's buckets, each bucket's chunks. One flush file per non-empty bucket."""
        self.version += 1
        version_dir = self.delta_dir / f"weight_v{self.version:06d}"
        version_dir.mkdir()
        answers, flush = [], 0
        for buckets in passes:
            files = []
            for bucket in buckets:
                if not any(encode(chunk, self.encoding)[2] for chunk in bucket):
                    continue
                name = f"rank0000_flush{flush:06d}.safetensors"
                (version_dir / name).write_bytes(
                    flush_bytes(bucket, encoding=self.encoding, version=self.version)
                )
                files.append(name)
                flush += 1
            if files:
                answers.append(self.push(str(version_dir), files))
        if not answers:  # nothing changed: the seed bumps the engine's recorded version instead
            answers.append(
                requests.post(
                    f"{self.url}/update_weight_version",
                    json={"new_version": str(self.version)},
                    headers=self.headers,
                    timeout=60,
                )
            )
        return answers

    def push(self, model_path: str, files: list[str]) -> requests.Response:
        body = {
            "model_path": model_path,
            "files": files,
            "load_format": "delta",
            "weight_version": str(self.version),
        }
        self.pushes.append(body)
        return requests.post(
            f"{self.url}/update_weights_from_disk", json=body, headers=self.headers, timeout=300
        )
