"""Sizes read from a file are checked in exact arithmetic, and malformed metadata is a `FormatError`.

Why: lengths summed as numpy int64 wrap silently, so a crafted index whose block lengths add up to the
stream's size modulo 2^64 passed the check and then pointed outside the stream (issue 33, class 1).
And a JSON value of the wrong kind must be the project's own error, never a TypeError or RecursionError.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from vllm_delta.wire import (
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
