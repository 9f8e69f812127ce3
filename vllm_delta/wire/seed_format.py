"""Reader for flush files in the seed's published layout (docs/wire-format.md, "Seed format"), so
seed-built trainers can push to us."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ValidationError

from .container import DeltaDir, Limits
from .deltas import ParamDelta
from .digest import bytes_digest
from .dtypes import DType, by_name, from_bits, to_bits
from .encodings import get_encoding
from .errors import FormatError, IncompleteDeltaError, IntegrityError, UnknownEncodingError
from .flush import open_flush
from .flush_meta import Expected, FlushHeader, HeadCheck, meta_int, meta_json
from .manifest import MANIFEST_NAME, FileEntry, Manifest, NonNeg, ParamEntry

SEED_ENCODINGS = ("indices", "deltas", "deltas_zstd")
_MASK64 = (1 << 64) - 1
_HASH_CHUNK = 1 << 22  # elements widened at a time, so hashing a large flush stays bounded in memory


def seed_hash(data: bytes | memoryview, d: DType) -> int:
    """`torch.hash_tensor(t)` (mode 0) of the 1-D tensor of dtype `d` whose bytes are `data`: elements
    widened to float64 or int64 by torch itself (any torch works), bit-cast to uint64, XORed."""
    bits = np.frombuffer(data, dtype=d.uint)
    wide = torch.float64 if d.is_float else torch.int64
    acc = 0
    for start in range(0, bits.size, _HASH_CHUNK):
        chunk = from_bits(bits[start : start + _HASH_CHUNK].copy(), d).to(wide)
        acc ^= int(np.bitwise_xor.reduce(chunk.view(torch.int64).numpy().view(np.uint64)))
    return acc


def seed_checksum(positions: bytes | memoryview, values: bytes | memoryview, values_dtype: DType) -> int:
    """The seed's `hash_tensor(positions) ^ (hash_tensor(values) << 1)` as an unsigned 64-bit integer;
    `positions` is the uint8 blob."""
    return (seed_hash(positions, by_name("uint8")) ^ (seed_hash(values, values_dtype) << 1)) & _MASK64


class _SeedParam(BaseModel):
    name: str
    dtype: str
    shape: list[NonNeg]
    pos_start: NonNeg
    pos_end: NonNeg
    pos_width: int
    val_start: NonNeg
    val_end: NonNeg


def decode_seed_flush(
    tensors, meta: Mapping[str, str], *, file: str, expected: Expected | None = None
) -> tuple[FlushHeader, list[ParamDelta]]:
    encoding = meta.get("encoding", "")
    if encoding not in SEED_ENCODINGS:
        raise UnknownEncodingError(f"unknown seed encoding {encoding!r}", file=file)
    header = FlushHeader(encoding, meta_int(meta, "current_version", file=file), None)
    pos_t, val_t = tensors.get("__positions__"), tensors.get("__values__")
    if (
        pos_t is None
        or val_t is None
        or pos_t.dtype.st_code != "U8"
        or len(pos_t.shape) != 1
        or len(val_t.shape) != 1
    ):
        raise FormatError("seed flush needs 1-D `__positions__` (uint8) and `__values__`", file=file)
    checksum = meta_int(meta, "checksum", file=file) & _MASK64
    if seed_checksum(pos_t.data, val_t.data, val_t.dtype) != checksum:
        raise IntegrityError("seed checksum does not match", file=file)
    try:
        params = [_SeedParam.model_validate(p) for p in meta_json(meta, "params", file=file)]
    except (ValidationError, TypeError) as e:
        raise FormatError(f"bad seed params: {e}", file=file) from None
    vd = val_t.dtype
    all_values = np.frombuffer(val_t.data, dtype=vd.uint)
    out = []
    heads, positions = HeadCheck(expected, file=file), get_encoding(encoding).positions
    for p in params:
        count = p.val_end - p.val_start
        d, shape, numel = heads(p.name, p.dtype, p.shape, count)
        if not (p.pos_start <= p.pos_end <= len(pos_t.data) and p.val_start <= p.val_end <= all_values.size):
            raise FormatError("param spans lie outside the blobs", file=file, param=p.name)
        spans = {"positions": pos_t.data[p.pos_start : p.pos_end]}
        pos = positions.decode(spans, count, p.pos_width, numel, file=file, param=p.name)
        values = _narrow(all_values[p.val_start : p.val_end], vd, d, file=file, param=p.name)
        if count:  # the seed may list a param with nothing changed
            out.append(ParamDelta(p.name, shape, d.torch, torch.from_numpy(pos), values, False))
    return header, out


def _narrow(bits: np.ndarray, vd: DType, d: DType, *, file: str, param: str) -> torch.Tensor:
    """Values in the param's dtype. The seed promoted bf16 to fp32; undo that only where exact."""
    if vd == d:
        return from_bits(bits.copy(), d)
    if (vd.name, d.name) == ("float32", "bfloat16"):  # bitwise, so NaN payloads survive
        if np.any(bits & np.uint32(0xFFFF)):
            raise FormatError("float32 values are not exact in bfloat16", file=file, param=param)
        return from_bits((bits >> np.uint32(16)).astype(np.uint16), d)
    wide = from_bits(bits.copy(), vd)
    narrow = wide.to(d.torch)
    if not np.array_equal(to_bits(narrow.to(vd.torch)), bits):
        raise FormatError(f"{vd.name} values are not exact in {d.name}", file=file, param=param)
    return narrow


def seed_manifest(d: DeltaDir, names: Sequence[str], limits: Limits) -> Manifest:
    """Describe a manifest-less seed delta by decoding its files once."""
    files, heads = [], set()
    params: dict[str, dict] = {}
    for name in names:
        data = d.read(name, cap=limits.max_decoded_bytes)
        tensors, meta, _ = open_flush(data, file=name, limits=limits)
        if "format" in meta or meta.get("encoding") not in SEED_ENCODINGS:
            raise IncompleteDeltaError("no manifest: the delta is unfinished", file=MANIFEST_NAME)
        header, deltas = decode_seed_flush(tensors, meta, file=name)
        heads.add((header.version, header.encoding))
        changed = sum(pd.count for pd in deltas)
        files.append(FileEntry(name=name, bytes=len(data), hash=bytes_digest(data), changed=changed))
        for pd in deltas:  # each with changes (`decode_seed_flush`)
            dtype = str(pd.dtype).removeprefix("torch.")
            new = dict(name=pd.name, dtype=dtype, shape=list(pd.shape), changed=0, files=[])
            e = params.setdefault(pd.name, new)
            e["changed"] += pd.count
            if name not in e["files"]:
                e["files"].append(name)
    if len(heads) != 1:
        raise FormatError("seed flush files disagree on version or encoding")
    ((version, encoding),) = heads
    return Manifest(
        version=version, encoding=encoding, files=files, params=[ParamEntry(**e) for e in params.values()]
    )
