"""Encoding a bucket of param changes into one flush (the byte layout: flush_meta.py, docs/wire-format.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .blocks import Policy, cuts, dense_cuts
from .container import compress, pack
from .deltas import ParamChange
from .dtypes import by_torch, to_bits
from .encodings import Encoding
from .flush_meta import FORMAT, FORMAT_BLOCKS


@dataclass(frozen=True)
class EncodedFlush:
    data: bytes
    decoded_bytes: int  # what reading it may decompress; goes into the manifest's FileEntry
    counts: list[tuple[str, int]]  # (param, changed) in flush order


def encode_flush(
    changes: Sequence[ParamChange],
    *,
    encoding: Encoding,
    version: int,
    base_version: int | None,
    blocked: bool = True,
    policy: Policy = Policy(),
) -> EncodedFlush:
    """Encode a bucket of changes; `blocked=False` writes the older `vllm-delta/1` layout."""
    if not blocked:
        return _encode_v1(changes, encoding=encoding, version=version, base_version=base_version)
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}
    params = []
    compressed = encoding.compression != "none"
    for ch, d, numel, pos, new, old in _arrays(changes):
        names: list[str] | None = None
        rows = []
        width = 0 if pos is None else encoding.positions.width(pos, numel)  # one pass per param
        for first, a, b, parts in _blocks(ch, encoding, d, numel, pos, new, old, policy, width):
            names = names or list(parts)
            lengths = []
            for s in names:
                raw = parts[s]
                blob = compress(raw, encoding.zstd_level) if compressed and raw else raw
                streams.setdefault(s, []).append(blob)
                sizes[s] = sizes.get(s, 0) + len(raw)
                lengths += [len(blob), len(raw)]
            rows.append([first, first + b - a - 1 if pos is None else int(pos[b - 1]), b - a, lengths])
        params.append({**_head(ch, d, len(new), width), "streams": names, "blocks": rows})
    meta = _header(
        encoding,
        version,
        base_version,
        FORMAT_BLOCKS,
        params,
        {s: {"codec": "zstd" if compressed else "raw", "size": n} for s, n in sizes.items()},
    )
    data = pack({f"__{s}__": b"".join(parts) for s, parts in streams.items()}, meta)
    return EncodedFlush(
        data, sum(sizes.values()) if compressed else 0, [(p["name"], p["count"]) for p in params]
    )


def _blocks(
    ch: ParamChange,
    encoding: Encoding,
    d,
    numel: int,
    pos: np.ndarray | None,
    new: np.ndarray,
    old: np.ndarray | None,
    policy: Policy,
    width: int,
):
    """(first position, entry offset, end offset, streams) of each block of one param (`width`: the
    param-wide position width)."""
    if pos is None:  # implicit positions: dense blocks, value streams only
        assert ch.ranges is not None  # no positions: the change is its ranges (`ParamChange`)
        for first, a, n in dense_cuts(ch.ranges, policy):
            yield (
                first,
                a,
                a + n,
                encoding.values.encode(new[a : a + n], None, d),  # no base: add_dense refuses one
            )
        return
    starts = cuts(pos, policy)
    for a, b in zip(starts, [*starts[1:], len(pos)]):
        _, parts = encoding.encode_param(
            pos[a:b],
            numel,
            new[a:b],
            None if old is None else old[a:b],
            d,
            prev=int(pos[a - 1]) if a else -1,
            width=width,
        )
        yield int(pos[a]), a, b, parts


def _arrays(changes: Sequence[ParamChange], *, explicit: bool = False):
    """Host arrays of each change; `pos` is None for implicit positions unless `explicit`."""
    for ch in changes:
        d = by_torch(ch.new_values.dtype)
        numel = int(np.prod(ch.shape, dtype=np.int64))
        if ch.positions is not None:
            pos = ch.positions.detach().cpu().numpy().astype(np.int64, copy=False)
        elif explicit:  # `vllm-delta/1` has no implicit form
            assert ch.ranges is not None  # no positions: the change is its ranges (`ParamChange`)
            pos = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in ch.ranges])
        else:
            pos = None
        new = to_bits(ch.new_values.detach().cpu().contiguous())
        old = None if ch.old_values is None else to_bits(ch.old_values.detach().cpu().contiguous())
        yield ch, d, numel, pos, new, old


def _head(ch: ParamChange, d, count: int, width: int) -> dict:
    """A param's metadata fields shared by both layouts, in the order the format writes them."""
    return {"name": ch.name, "dtype": d.name, "shape": list(ch.shape), "count": count, "width": width}


def _header(
    encoding: Encoding, version: int, base_version: int | None, fmt: str, params: list, streams: dict
) -> dict[str, str]:
    return {
        "format": fmt,
        "encoding": encoding.name,
        "current_version": str(version),
        "base_version": "" if base_version is None else str(base_version),
        "streams": json.dumps(streams),
        "params": json.dumps(params, separators=(",", ":")),
    }


def _encode_v1(
    changes: Sequence[ParamChange], *, encoding: Encoding, version: int, base_version: int | None
) -> EncodedFlush:
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}
    params = []
    for ch, d, numel, pos, new, old in _arrays(changes, explicit=True):
        width, parts = encoding.encode_param(pos, numel, new, old, d)
        spans = {}
        for s, blob in parts.items():
            start = sizes.get(s, 0)
            streams.setdefault(s, []).append(blob)
            sizes[s] = start + len(blob)
            spans[s] = [start, start + len(blob)]
        params.append({**_head(ch, d, len(pos), width), "spans": spans})
    raw = {s: b"".join(parts) for s, parts in streams.items()}
    per_stream = encoding.compression == "streams"
    blobs = {f"__{s}__": compress(b, encoding.zstd_level) if per_stream else b for s, b in raw.items()}
    meta = _header(
        encoding,
        version,
        base_version,
        FORMAT,
        params,
        {s: {"codec": "zstd" if per_stream else "raw", "size": len(b)} for s, b in raw.items()},
    )
    data = pack(blobs, meta)
    decoded = sum(sizes.values()) if per_stream else 0
    if encoding.compression == "file":
        data, decoded = compress(data, encoding.zstd_level), len(data)
    return EncodedFlush(data, decoded, [(p["name"], p["count"]) for p in params])
