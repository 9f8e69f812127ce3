"""Hostile and damaged input: each case raises its own error type, naming file and reason."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import zstandard
from wire_helpers import seed_flush_bytes, write_delta

from vllm_delta.wire import (
    BoundsError,
    DeltaError,
    DtypeMismatchError,
    FormatError,
    IncompleteDeltaError,
    IntegrityError,
    LimitError,
    Limits,
    Manifest,
    ParamChange,
    ParamEntry,
    ShapeMismatchError,
    UnknownDtypeError,
    UnknownParamError,
    bytes_digest,
    encode_flush,
    file_entry,
    get_encoding,
    open_delta,
    read_delta,
    write_manifest,
)
from vllm_delta.wire.codecs import decode_gaps
from vllm_delta.wire.container import pack, unpack

F = "rank0000_flush000000.safetensors"


def good_delta(tmp_path, encoding="ulp_zstd", blocked=True):
    old = torch.randn(64, 16).bfloat16()
    new = old.clone()
    new.view(-1)[::5] = 0.25
    return write_delta(tmp_path / "d", {"w": old}, {"w": new}, encoding=encoding, blocked=blocked), old


def crafted(
    tmp_path, positions, *, encoding="indices", shape=(10,), dtype="bfloat16", flush=None, blocked=True
):
    """A delta whose flush is encoded without the writer's checks, with a matching manifest."""
    pos = torch.tensor(positions, dtype=torch.int64)
    vals = torch.ones(len(positions), dtype=torch.bfloat16)
    enc = get_encoding(encoding)
    flush = flush or encode_flush(
        [ParamChange("w", shape, pos, vals, vals)], encoding=enc, version=1, base_version=0, blocked=blocked
    )
    d = tmp_path / "c"
    d.mkdir()
    (d / F).write_bytes(flush.data)
    write_manifest(
        d,
        Manifest(
            version=1,
            base_version=0,
            encoding=encoding,
            files=[file_entry(F, flush)],
            params=[ParamEntry(name="w", dtype=dtype, shape=list(shape), changed=len(positions), files=[F])],
        ),
    )
    return d


def replace_file(d, data: bytes, **manifest_changes):
    """Swap a flush file and re-sign the manifest, as an attacker who controls both could."""
    (d / F).write_bytes(data)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data), **manifest_changes)
    (d / "manifest.json").write_text(json.dumps(m))


def read(d, **kw):
    return read_delta(d, current_version=0, **kw)


def test_truncated_file(tmp_path):
    d, _ = good_delta(tmp_path)
    data = (d / F).read_bytes()
    (d / F).write_bytes(data[:-10])
    with pytest.raises(IntegrityError, match="truncated") as e:
        read(d)
    assert e.value.file == F and e.value.http_status == 400


def test_truncated_file_with_resigned_manifest(tmp_path):
    d, _ = good_delta(tmp_path)
    replace_file(d, (d / F).read_bytes()[:-10])
    with pytest.raises(FormatError, match="truncated|outside"):
        read(d)


def test_truncated_seed_file(tmp_path):
    old = torch.randn(100)
    new = old + 1
    (tmp_path / F).write_bytes(seed_flush_bytes([("w", old, new)])[:-7])
    with pytest.raises(FormatError, match="outside the file"):
        open_delta(tmp_path, allow_seed=True)


def test_flipped_byte(tmp_path):
    d, _ = good_delta(tmp_path)
    data = bytearray((d / F).read_bytes())
    data[len(data) // 2] ^= 0x40
    (d / F).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="hash"):
        read(d)


def test_wrong_hash_in_manifest(tmp_path):
    d, _ = good_delta(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0]["hash"] = "0" * 32
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError):
        read(d)


def test_header_bomb(tmp_path):
    d, _ = good_delta(tmp_path)
    data = (d / F).read_bytes()
    replace_file(d, struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(LimitError, match="header"):
        read(d)


def test_header_over_the_configured_limit(tmp_path):
    d, _ = good_delta(tmp_path)
    with pytest.raises(LimitError):
        read(d, limits=Limits(max_header_bytes=64))


@pytest.mark.parametrize("declared_size", [True, False])
def test_zstd_bomb_whole_file(tmp_path, declared_size):
    d, _ = good_delta(tmp_path, encoding="deltas_zstd")
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=declared_size)
    bomb = cctx.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few KiB
    assert len(bomb) < 1 << 16
    replace_file(d, bomb)
    with pytest.raises(LimitError, match="zstd|limit"):
        read(d)


def test_zstd_bomb_in_a_stream(tmp_path):
    d, _ = good_delta(tmp_path, encoding="ulp_zstd", blocked=False)
    tensors, meta = unpack((d / F).read_bytes(), file=F, limits=Limits())
    blobs = {k: bytes(t.data) for k, t in tensors.items()}
    blobs["__flag__"] = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (32 << 20))
    replace_file(d, pack(blobs, meta))
    with pytest.raises(LimitError):
        read(d)


def test_zstd_bomb_in_a_block(tmp_path):
    # A block's frame that hides its size and expands past what the index says it decodes to.
    d, _ = good_delta(tmp_path, encoding="ulp_zstd")
    tensors, meta = unpack((d / F).read_bytes(), file=F, limits=Limits())
    blobs = {k: bytes(t.data) for k, t in tensors.items()}
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (32 << 20))
    params = json.loads(meta["params"])
    (block,) = params[0]["blocks"]
    j = params[0]["streams"].index("flag")
    block[3][2 * j] = len(bomb)
    blobs["__flag__"] = bomb
    replace_file(d, pack(blobs, dict(meta, params=json.dumps(params))))
    with pytest.raises(LimitError, match="flag|block") as e:
        read(d)
    assert e.value.param == "w"


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("encoding", ["indices", "deltas", "planes_zstd", "ulp_zstd"])
def test_out_of_range_positions(tmp_path, encoding, blocked):
    d = crafted(tmp_path, [2, 10], encoding=encoding, blocked=blocked)
    with pytest.raises(BoundsError, match="range|exceeds") as e:
        read(d)
    assert e.value.param == "w" and e.value.file == F


def test_gap_sum_overflow_is_caught(tmp_path):
    # Gaps near 2^63 would wrap an int64 prefix sum back into range; they must be refused.
    gaps = np.array([2**62, 2**62, 2**62, 2**62, 3], dtype=np.uint64)
    with pytest.raises(BoundsError):
        decode_gaps(gaps, 10, file=F, param="w")


@pytest.mark.parametrize("blocked", [False, True])
def test_duplicate_positions(tmp_path, blocked):
    d = crafted(tmp_path, [3, 3, 4], blocked=blocked)
    with pytest.raises(BoundsError, match="strictly increasing") as e:
        read(d)
    assert e.value.param == "w"


def test_unknown_dtype(tmp_path):
    d = crafted(tmp_path, [1, 2], dtype="float128")
    with pytest.raises(UnknownDtypeError) as e:
        read(d)
    assert e.value.http_status == 422


def test_unknown_dtype_in_safetensors_header(tmp_path):
    d, _ = good_delta(tmp_path)
    data = (d / F).read_bytes().replace(b'"U8"', b'"U9"', 1)
    replace_file(d, data)
    with pytest.raises(UnknownDtypeError):
        read(d)


def test_manifest_naming_a_missing_file(tmp_path):
    d, _ = good_delta(tmp_path)
    (d / F).unlink()
    with pytest.raises(IncompleteDeltaError, match="missing") as e:
        read(d)
    assert e.value.file == F


def test_unfinished_delta_without_manifest(tmp_path):
    d, _ = good_delta(tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(IncompleteDeltaError, match="unfinished"):
        read(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(IncompleteDeltaError):
        read(tmp_path / "empty")


def test_change_count_disagrees_with_manifest(tmp_path):
    d, _ = good_delta(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["params"][0]["changed"] += 1
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BoundsError, match="changes"):
        read(d)


def test_garbage_and_unsafe_manifests(tmp_path):
    d, _ = good_delta(tmp_path)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError):
        read(d)
    m = {"version": 1, "encoding": "indices", "files": [{"name": "../etc/passwd", "bytes": 1, "hash": "x"}]}
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="unsafe"):
        read(d)


def test_model_mismatches_are_422(tmp_path):
    d, _ = good_delta(tmp_path)
    cases = [
        ({"v": ((64, 16), torch.bfloat16)}, UnknownParamError),
        ({"w": ((16, 64), torch.bfloat16)}, ShapeMismatchError),
        ({"w": ((64, 16), torch.float32)}, DtypeMismatchError),
    ]
    for expected, err in cases:
        with pytest.raises(err) as e:
            read(d, expected=expected)
        assert e.value.http_status == 422 and e.value.param == "w"


def test_metadata_spans_outside_streams(tmp_path):
    d, _ = good_delta(tmp_path, encoding="deltas", blocked=False)
    tensors, meta = unpack((d / F).read_bytes(), file=F, limits=Limits())
    params = json.loads(meta["params"])
    params[0]["spans"]["positions"] = [0, 1 << 30]
    meta = dict(meta, params=json.dumps(params))
    replace_file(d, pack({k: bytes(t.data) for k, t in tensors.items()}, meta))
    with pytest.raises(FormatError, match="out of bounds"):
        read(d)


def test_every_error_is_a_delta_error():
    for err in (
        BoundsError,
        FormatError,
        IncompleteDeltaError,
        IntegrityError,
        LimitError,
        UnknownDtypeError,
        UnknownParamError,
    ):
        assert issubclass(err, DeltaError)
