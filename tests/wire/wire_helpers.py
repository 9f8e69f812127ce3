"""Helpers for the wire tests: a seed-format writer and small HF-style checkpoint directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import zstandard
from safetensors.torch import save, save_file

from vllm_delta.diff import diff_param
from vllm_delta.wire import DeltaWriter, tensor_digest
from vllm_delta.wire.codecs import encode_gaps


def write_delta(
    path: Path,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    encoding: str = "ulp_zstd",
    version: int = 1,
    base_version: int | None = 0,
    flush_bytes: int = 1 << 20,
    blocked: bool = True,
) -> Path:
    with DeltaWriter(
        path,
        version=version,
        base_version=base_version,
        encoding=encoding,
        flush_bytes=flush_bytes,
        blocked=blocked,
    ) as w:
        for name, t in new.items():
            d = diff_param(t, old[name])
            w.add(name, d.positions, d.new_values, d.old_values, shape=t.shape, post_hash=tensor_digest(t))
    return path


def seed_flush_bytes(
    changes: list[tuple[str, torch.Tensor, torch.Tensor]],
    *,
    encoding: str = "deltas",
    version: int = 1,
    promote: bool = False,
    pos_width: int | None = None,
) -> bytes:
    """A flush in the seed's documented layout (docs/wire-format.md, "Seed format").

    `changes` is (name, old, new). `promote` concatenates values as float32, like the seed did
    for mixed dtypes. The checksum is `torch.hash_tensor(positions) ^ (torch.hash_tensor(values) << 1)`.
    """
    blobs, vals, params, pos_off, val_off = [], [], [], 0, 0
    for name, old, new in changes:
        d = diff_param(new, old)
        pos = d.positions.numpy()
        if encoding == "indices":
            w = pos_width or 4
            blob = pos.astype(f"<i{w}").tobytes()
        else:
            w, gaps = encode_gaps(pos)
            w = max(w, pos_width or 2)
            blob = gaps.astype(f"<u{w}").tobytes()
        v = d.new_values.float() if promote else d.new_values
        params.append(
            {
                "name": name,
                "dtype": str(new.dtype),
                "shape": list(new.shape),
                "pos_start": pos_off,
                "pos_end": pos_off + len(blob),
                "pos_width": w,
                "val_start": val_off,
                "val_end": val_off + v.numel(),
            }
        )
        blobs.append(blob)
        vals.append(v)
        pos_off += len(blob)
        val_off += v.numel()
    positions = (
        torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        if pos_off
        else torch.zeros(0, dtype=torch.uint8)
    )
    values = torch.cat(vals)
    # Computed by torch.hash_tensor itself, as the seed did: never by the reader's own function.
    # torch 2.13 has no uint64 `<<` on the CPU: shift the integer, wrapping at 2^64 as uint64 does.
    checksum = torch.hash_tensor(positions).item() ^ (
        (torch.hash_tensor(values).item() << 1) & ((1 << 64) - 1)
    )
    data = save(
        {"__positions__": positions, "__values__": values},
        metadata={
            "encoding": encoding,
            "params": json.dumps(params),
            "current_version": str(version),
            "checksum": str(checksum),
        },
    )
    return zstandard.ZstdCompressor(level=1).compress(data) if encoding == "deltas_zstd" else data


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(64, 32, generator=g) * 0.02).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(32, 32, generator=g) * 0.02).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(32, 48, generator=g) * 0.02).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": (torch.randn(64, 32, generator=g) * 0.02).bfloat16(),
    }


def perturb(tensors: dict[str, torch.Tensor], seed: int, density: float = 0.05) -> dict[str, torch.Tensor]:
    """Move a random subset of elements by one ULP (and leave `model.norm.weight` untouched)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        if name != "model.norm.weight":
            bits = t.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
            mask = torch.rand(bits.shape, generator=g) < density
            bits[mask] += 1
        out[name] = t
    return out


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], *, sharded: bool) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    (path / "tokenizer_config.json").write_text("{}")
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
