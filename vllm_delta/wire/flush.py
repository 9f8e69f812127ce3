"""Decoding one flush (a file, or a buffer broadcast over a collective): a block-indexed one in batches
(wire/batch.py) where it can be, the per-param path here taking the rest (the precise error, large
params) and `vllm-delta/1`'s byte spans."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized

import numpy as np
import torch

from .batch import decode as decode_batches
from .batch import parse as index_flush
from .batch_device import HOST, Decoder
from .batch_host import Fallback
from .blocks import BlockIndex, Ranges, merge, parse_index, runs, wanted
from .container import ZSTD_MAGIC, Limits, decompress, paused_gc, unpack
from .deltas import DeltaBatch, ParamDelta
from .digest import bytes_digest
from .encodings import Encoding, get_encoding
from .errors import BoundsError, FormatError, IntegrityError, LimitError
from .flush_meta import (
    FORMAT_BLOCKS,
    Expected,
    FlushHeader,
    HeadCheck,
    heads_from_text,
    meta_int,
    meta_json,
    parse_params,
    parse_streams,
)

Owned = Mapping[str, Ranges | None]  # per param: the position ranges to decode (None: all)


def open_flush(
    data: bytes | bytearray | memoryview,
    *,
    file: str,
    limits: Limits,
    max_decoded: int | None = None,
    expected_hash: str | None = None,
):
    """Check the hash, undo whole-file zstd, parse the container: (tensors, metadata, budget left)."""
    if expected_hash is not None and bytes_digest(data) != expected_hash:
        raise IntegrityError("file hash does not match the manifest", file=file)
    budget = limits.max_decoded_bytes if max_decoded is None else min(max_decoded, limits.max_decoded_bytes)
    if bytes(data[:4]) == ZSTD_MAGIC:
        data = decompress(data, budget, file=file, what="file")
        budget -= len(data)
    tensors, meta = unpack(data, file=file, limits=limits)
    return tensors, meta, budget


def iter_flush(
    tensors,
    meta: Mapping[str, str],
    budget: int,
    *,
    file: str,
    expected: Expected | None = None,
    owned: Owned | None = None,
    batches: bool = False,
    decoder: Decoder = HOST,
) -> tuple[FlushHeader, Iterator[ParamDelta | DeltaBatch]]:
    """Check a flush's metadata (and block index) now; decode its params lazily, so a receiver holds one
    param's changes at a time (a param's data errors when it is reached). `owned`: decode only the blocks
    meeting these ranges; `batches`: a run the batched decoder took whole comes as one `DeltaBatch`."""
    enc = get_encoding(meta.get("encoding", ""), file=file)
    header = FlushHeader(
        enc.name,
        meta_int(meta, "current_version", file=file),
        None if meta.get("base_version") in (None, "") else meta_int(meta, "base_version", file=file),
    )
    blocked = meta.get("format") == FORMAT_BLOCKS
    with paused_gc():  # a few objects per param (container.paused_gc says why)
        smeta = parse_streams(meta, file=file)
        heads = heads_from_text(meta.get("params")) if blocked else None  # the writer's text, read fast
        if heads is None:
            heads = parse_params(meta_json(meta, "params", file=file), blocked=blocked, file=file)
        if sum(s.size for s in smeta.values() if s.codec == "zstd") > budget:
            raise LimitError("streams would decompress past the declared size", file=file)
        data: dict[str, memoryview] = {}
        for name in smeta:
            t = tensors.get(f"__{name}__")
            if t is None or t.dtype.st_code != "U8" or len(t.shape) != 1:
                raise FormatError(f"stream {name!r} missing or not a 1-D uint8 tensor", file=file)
            data[name] = t.data
        if not blocked:
            return header, _iter_v1(enc, smeta, data, heads.entries(), file=file, expected=expected)
        try:  # the batched path first, the per-param path from where it stops
            index = index_flush(enc, smeta, data, heads, file=file, expected=expected)
        except Fallback:
            plan = plan_blocked(smeta, data, meta, file=file, expected=expected)
            return header, _decode_blocked(enc, smeta, data, plan, file=file, owned=owned)
    del heads  # the batched path has its arrays: the collector never walks the parsed metadata
    plans: list = []

    def fallback(i: int, j: int) -> Iterator[ParamDelta]:
        if not plans:  # parsed again, for the per-param path's plans
            plans.extend(plan_blocked(smeta, data, meta, file=file, expected=expected))
        return _decode_blocked(enc, smeta, data, plans[i:j], file=file, owned=owned)

    return header, decode_batches(enc, index, data, owned, decoder, fallback, batches)


def _delta(enc: Encoding, name: str, shape, d, pos: np.ndarray, payload: np.ndarray, **extra) -> ParamDelta:
    values = torch.from_numpy(np.ascontiguousarray(payload).view(f"<i{d.itemsize}"))  # the steps, or the bits
    values = values if enc.needs_base else values.view(d.torch)
    return ParamDelta(name, shape, d.torch, torch.from_numpy(pos), values, enc.needs_base, **extra)


def _iter_v1(
    enc: Encoding, smeta, data, pmeta, *, file: str, expected: Expected | None
) -> Iterator[ParamDelta]:
    streams: dict[str, memoryview] = {}
    for name, s in smeta.items():
        if s.codec == "zstd":
            streams[name] = memoryview(decompress(data[name], s.size, exact=s.size, file=file, what=name))
        elif len(data[name]) != s.size:
            raise FormatError(f"stream {name!r}: {len(data[name])} B, declared {s.size} B", file=file)
        else:
            streams[name] = data[name]
    heads = HeadCheck(expected, file=file)
    shapes = [heads(p.name, p.dtype, p.shape, p.count) for p in pmeta]
    for p in pmeta:
        for s, (a, b) in p.spans.items():
            if s not in streams or not a <= b <= len(streams[s]):
                raise FormatError(f"span of stream {s!r} out of bounds", file=file, param=p.name)
    for p, (d, shape, numel) in zip(pmeta, shapes):
        spans = {s: streams[s][a:b] for s, (a, b) in p.spans.items()}
        pos = enc.positions.decode(spans, p.count, p.width, numel, file=file, param=p.name)
        yield _delta(
            enc, p.name, shape, d, pos, enc.values.decode(spans, p.count, d, file=file, param=p.name)
        )


def plan_blocked(smeta, data: Mapping[str, Sized], meta: Mapping[str, str], *, file: str, expected) -> list:
    """The per-param path's checks of every param's head and block index, and its decode plans
    `(param, dtype, shape, numel, index, each stream's start)`; only `data`'s lengths are read."""
    with paused_gc():
        pmeta = parse_params(meta_json(meta, "params", file=file), blocked=True, file=file).entries()
    cursor, decoded = dict.fromkeys(smeta, 0), dict.fromkeys(smeta, 0)  # the params' blocks back to back
    plans = []
    heads = HeadCheck(expected, file=file)
    for p in pmeta:
        d, shape, numel = heads(p.name, p.dtype, p.shape, p.count)
        if len(set(p.streams)) != len(p.streams) or any(s not in smeta for s in p.streams):
            raise FormatError(f"unknown or repeated streams {p.streams}", file=file, param=p.name)
        raw = [smeta[s].codec == "raw" for s in p.streams]
        index = parse_index(p, numel, file=file)
        if any(raw) and not np.array_equal(index.stored[:, raw], index.decoded[:, raw]):
            raise FormatError("raw block lengths differ from their decoded lengths", file=file, param=p.name)
        starts = {}
        for j, s in enumerate(p.streams):
            starts[s] = cursor[s]
            cursor[s] += sum(index.stored[:, j].tolist())  # Python ints: int64 sums of a file's lengths wrap
            decoded[s] += sum(index.decoded[:, j].tolist())
        plans.append((p, d, shape, numel, index, starts))
    for s, m in smeta.items():
        if cursor[s] != len(data[s]) or decoded[s] != m.size:
            raise FormatError(
                f"stream {s!r}: blocks span {cursor[s]} of {len(data[s])} B, decode to "
                f"{decoded[s]} of the declared {m.size} B",
                file=file,
            )
    return plans


def _decode_blocked(
    enc: Encoding, smeta, data, plans, *, file: str, owned: Owned | None
) -> Iterator[ParamDelta]:
    for p, d, shape, numel, index, starts in plans:
        ranges = None if owned is None else owned.get(p.name)
        mask = wanted(index, None if ranges is None else merge(ranges))
        offsets = [
            starts[s] + np.concatenate(([0], np.cumsum(index.stored[:, j]))) for j, s in enumerate(p.streams)
        ]

        def spans(k: int, m: int, p=p, offsets=offsets, index=index) -> dict[str, memoryview]:
            return {
                s: _run_bytes(data[s], smeta[s].codec, offsets[j], index, j, k, m, file=file, param=p.name)
                for j, s in enumerate(p.streams)
            }

        if p.width == 0:  # implicit positions: each dense block on its own (counts need not be x8)
            parts = []
            for k in np.flatnonzero(mask).tolist():  # positions first..last (the index, checked in range)
                pos = np.arange(index.first[k], index.last[k] + 1, dtype=np.int64)
                parts.append((pos, enc.values.decode(spans(k, k + 1), pos.size, d, file=file, param=p.name)))
        else:
            parts = [
                _decode_run(enc, p, d, numel, index, k, m, spans(k, m), file=file) for k, m in runs(mask)
            ]
        pos = np.concatenate([x for x, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        payload = np.concatenate([v for _, v in parts]) if parts else np.zeros(0, dtype=d.uint)
        bounds, blocks = (int(index.first[0]), int(index.last[-1])), (int(mask.sum()), index.size)
        yield _delta(
            enc, p.name, shape, d, pos, payload, skipped=p.count - pos.size, bounds=bounds, blocks=blocks
        )


def _decode_run(
    enc: Encoding, p, d, numel: int, index: BlockIndex, k: int, m: int, spans, *, file: str
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks k..m-1 of explicit positions, decoded as one: gaps continue across blocks."""
    counts, at = index.count[k:m], {"file": file, "param": p.name}
    n, prev = int(counts.sum()), int(index.last[k - 1]) if k else -1
    pos = enc.positions.decode(spans, n, p.width, numel, prev=prev, **at)
    payload = enc.values.decode(spans, n, d, **at)
    heads = np.cumsum(counts) - counts
    if not (
        np.array_equal(pos[heads], index.first[k:m])
        and np.array_equal(pos[heads + counts - 1], index.last[k:m])
        and _block_flags_agree(p, index, k, m, heads, spans.get("flag"))
    ):
        raise BoundsError("positions or ULP flags disagree with the block index", file=file, param=p.name)
    return pos, payload


def _block_flags_agree(p, index: BlockIndex, k: int, m: int, heads: np.ndarray, flags) -> bool:
    """ULP steps: each block's flags name as many escapes as its own `esc0` holds, as a decode of that
    block alone (another rank's, or the batched paths') requires (found by tests/fuzz)."""
    if flags is None or "esc0" not in p.streams:
        return True
    f, e = p.streams.index("flag"), p.streams.index("esc0")
    counts, nbytes = index.count[k:m], index.decoded[k:m, f]
    if not np.array_equal(nbytes, (counts + 7) // 8):
        return False
    bits = np.unpackbits(np.frombuffer(flags, dtype=np.uint8))
    at = np.repeat(8 * (np.cumsum(nbytes) - nbytes) - heads, counts) + np.arange(int(counts.sum()))
    return np.array_equal(np.add.reduceat(bits[at].astype(np.int64), heads), index.decoded[k:m, e])


def _run_bytes(
    stream: memoryview, codec: str, offsets: np.ndarray, index: BlockIndex, j: int, k: int, m: int, **at
) -> memoryview:
    """Decoded bytes of stream column `j` for blocks k..m-1 (`offsets`: the blocks' starts and end)."""
    if codec == "raw":
        return stream[int(offsets[k]) : int(offsets[m])]
    parts = []
    for i, n in zip(range(k, m), index.decoded[k:m, j].tolist()):
        lo, hi, what = int(offsets[i]), int(offsets[i + 1]), f"block {i} of stream {j}"
        if hi == lo and n:
            raise FormatError(f"{what} is empty but decodes to {n} B", **at)
        parts.append(decompress(stream[lo:hi], n, exact=n, what=what, **at) if hi > lo else b"")
    return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
