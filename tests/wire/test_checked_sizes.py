"""Sizes read from a file are checked in exact arithmetic, and malformed metadata is a `FormatError`.

Why: lengths summed as numpy int64 wrap silently, so a crafted index whose block lengths add up to the
stream's size modulo 2^64 passed the check and then pointed outside the stream (issue 33, class 1).
And a JSON value of the wrong kind must be the project's own error, never a TypeError or RecursionError.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
import zstandard

from vllm_delta.wire import (
    DeltaDecoder,
    DeltaWriter,
    FormatError,
    Limits,
    bytes_digest,
    iter_delta,
    open_delta,
    parse_manifest,
)
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import pack, unpack

SMALL_BLOCKS = Policy(span_bits=6, min_entries=8, max_entries=64)  # 8 entries a block below


def _delta(path: Path) -> Path:
    old = torch.zeros(4096, dtype=torch.bfloat16)
    pos = torch.arange(0, 4096, 8)
    with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd", block_policy=SMALL_BLOCKS) as w:
        w.add("w", pos, (old[pos].view(torch.int16) + 1).view(torch.bfloat16), old[pos], shape=(4096,))
    return path


def _edit_flush(path: Path, edit) -> None:
    """Edit the flush's metadata (`edit(meta)` in place) and re-sign it in the manifest."""
    name = open_delta(path).manifest.files[0].name
    tensors, meta = unpack((path / name).read_bytes(), file=name, limits=Limits())
    edit(meta)
    data = pack({k: bytes(t.data) for k, t in tensors.items()}, meta)
    (path / name).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    (path / "manifest.json").write_text(json.dumps(m))


def _wrap_block_lengths(meta: dict) -> None:
    """Four blocks' stored lengths of the first stream each 2^62 longer: their sum is the same mod 2^64."""
    params = json.loads(meta["params"])
    (p,) = params
    assert len(p["blocks"]) > 5
    for row in p["blocks"][1:5]:
        row[3][0] += 1 << 62
    meta["params"] = json.dumps(params, separators=(",", ":"))


@pytest.mark.parametrize("batches", [False, True])
def test_block_lengths_that_wrap_int64_are_refused(tmp_path, batches):
    """Only block 0 is owned, so nothing but the index's sums can notice the lengths."""
    path = _delta(tmp_path / "d")
    assert len(list(iter_delta(open_delta(path), current_version=0, owned={"w": [(0, 7)]}, lazy=True))) == 1
    _edit_flush(path, _wrap_block_lengths)
    with pytest.raises(FormatError, match="blocks span"):
        list(
            iter_delta(open_delta(path), current_version=0, owned={"w": [(0, 7)]}, lazy=True, batches=batches)
        )


@pytest.mark.parametrize(
    "key, value", [("params", "[" * 100_000 + "]" * 100_000), ("streams", "[" * 100_000 + "]" * 100_000)]
)
def test_deeply_nested_flush_metadata_is_a_format_error(tmp_path, key, value):
    path = _delta(tmp_path / "d")
    _edit_flush(path, lambda meta: meta.__setitem__(key, value))
    with pytest.raises(FormatError, match="not JSON"):
        list(iter_delta(open_delta(path), current_version=0))


def test_deeply_nested_manifest_is_a_format_error():
    with pytest.raises(FormatError, match="invalid manifest"):
        parse_manifest(("[" * 100_000 + "]" * 100_000).encode())


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 1]},
        {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]},
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_bad_safetensors_entries_are_format_errors(entry):
    text = ('{"x":' + entry + "}" if isinstance(entry, str) else json.dumps({"x": entry})).encode()
    data = struct.pack("<Q", len(text)) + text + b"\0"
    with pytest.raises(FormatError):
        unpack(data, file="f", limits=Limits())


def _frame_declaring(size: int) -> bytes:
    """A zstd frame whose header declares `size` decoded bytes (single segment, 8-byte content size),
    holding one raw block of 8 bytes."""
    block = struct.pack("<I", 1 | 8 << 3)[:3] + b"x" * 8  # last block, raw, 8 bytes
    return b"\x28\xb5\x2f\xfd" + b"\xe0" + struct.pack("<Q", size) + block


BOMB = 64 << 20  # decodes to this from a frame of a few KB; its header states no size


def _bomb(size: int) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=False).compress(bytes(BOMB))


def _swap_frame(make):
    """Block 1 of the first stream becomes frame `make(n)`, its decoded length n = 2^62 + the old one;
    blocks 2-4 each decode 2^62 more: the lengths' int64 sums still match the stream's declared size
    (and the manifest's decoded bytes), so only exact sums notice."""

    def edit(meta: dict, tensors: dict) -> None:
        params = json.loads(meta["params"])
        (p,) = params
        stream = f"__{p['streams'][0]}__"
        rows = p["blocks"]
        data = bytes(tensors[stream])
        at = sum(r[3][0] for r in rows[:1])
        old_stored = rows[1][3][0]
        n = (1 << 62) + rows[1][3][1]
        frame = make(n)
        tensors[stream] = data[:at] + frame + data[at + old_stored :]
        rows[1][3][0], rows[1][3][1] = len(frame), n
        for row in rows[2:5]:
            row[3][1] += 1 << 62
        meta["params"] = json.dumps(params, separators=(",", ":"))

    return edit


def _edit_streams(path: Path, edit) -> None:
    """`_edit_flush`, with the stream tensors' bytes editable too (`edit(meta, tensors)`)."""
    name = open_delta(path).manifest.files[0].name
    raw, meta = unpack((path / name).read_bytes(), file=name, limits=Limits())
    tensors = {k: bytes(t.data) for k, t in raw.items()}
    edit(meta, tensors)
    data = pack(tensors, meta)
    (path / name).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("batches", [False, True])
@pytest.mark.parametrize("make", [_frame_declaring, _bomb], ids=["header-2^62", "bomb"])
def test_a_frame_past_the_manifests_decoded_bytes_allocates_nothing(tmp_path, make, batches):
    """Issue 33, class 1: a frame whose header declares 2^62 B raised MemoryError; a frame of no
    stated size decoded 64 MiB (1.4 GiB in the issue's case) from a flush whose manifest allows a
    few hundred bytes, before the FormatError. Now refused from the lengths, holding a few MB."""
    path = _delta(tmp_path / "d")
    _edit_streams(path, _swap_frame(make))
    assert json.loads((path / "manifest.json").read_text())["files"][0]["decoded_bytes"] < 4096
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="blocks span"):
            list(iter_delta(open_delta(path), current_version=0, lazy=True, batches=batches))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_concurrent_decodes_hold_at_most_max_decoded_at_once(tmp_path, monkeypatch):
    """`iter_delta(threads=)` starts a flush only while the decoded bytes the manifest allows the
    flushes held stay within `Limits.max_decoded_at_once`: with room for one, the decodes run one
    after another (each starts once the one before was consumed), whatever the thread count."""
    g = torch.Generator().manual_seed(0)
    with DeltaWriter(tmp_path / "d", version=1, base_version=0, encoding="ulp_zstd", flush_bytes=1) as w:
        for i in range(4):
            old = torch.randn(64, generator=g).bfloat16()
            pos = torch.arange(0, 64, 8)
            w.add(f"p{i}", pos, (old[pos].view(torch.int16) + 1).view(torch.bfloat16), old[pos], shape=(64,))
    info = open_delta(tmp_path / "d")
    assert len(info.manifest.files) >= 4
    one = max(f.decoded_bytes for f in info.manifest.files)
    events: list[tuple[str, str]] = []
    decode = DeltaDecoder.decode

    def logged(self, name, data, **kwargs):
        events.append(("start", name))
        return decode(self, name, data, **kwargs)

    monkeypatch.setattr(DeltaDecoder, "decode", logged)
    limits = Limits(max_decoded_at_once=one)
    for pd in iter_delta(info, current_version=0, threads=4, limits=limits):
        events.append(("got", pd.name))
    starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
    assert [events[i][1] for i in starts] == [f.name for f in info.manifest.files]
    assert all(b - a > 1 for a, b in zip(starts, starts[1:])) and events[-1][0] == "got"
