"""Every parser of untrusted bytes refuses a mistyped or deeply nested value at any field with the
project's own error (`DeltaError`), never a TypeError, KeyError or RecursionError (issue 33, class 2).

Why: the engine maps `DeltaError` to 400/422 and leaves the weights alone; anything else is a 500,
which means a bug of ours. Each parser gets the writer's own input with one field at a time (at
every depth: the manifest's params, a flush's streams, params and block rows, a safetensors entry,
a seed file's params, a collective offer) replaced by each value of `BAD`.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable, Iterator

import pytest
import torch
from wire_helpers import seed_flush_bytes

from vllm_delta.wire import DeltaDecoder, DeltaError, DeltaWriter, Limits, bytes_digest, parse_manifest
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import json_loads, pack, unpack
from vllm_delta.wire.flush import open_flush
from vllm_delta.wire.seed_format import decode_seed_flush, seed_checksum

DEEP = "@deep@"  # replaced in the JSON text by 100k nested lists
BAD = [DEEP, {"a": 1}, [1], [[]], 1, -1, 2**70, 1.5, "x", "", None, True]
FILE = "rank0000_flush000000.safetensors"


def _paths(obj, at=()) -> Iterator[tuple]:
    """Every key path in a JSON value (dict keys and list indices), the value itself first."""
    yield at
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):  # a row or two of each list is enough: they are checked alike
            yield from _paths(v, (*at, i))


def _replaced(obj, path: tuple, value):
    out = copy.deepcopy(obj)
    if not path:
        return value
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _text(obj) -> str:
    return json.dumps(obj, separators=(",", ":")).replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000)


def _escaped(obj, parse: Callable[[str], object]) -> list[str]:
    """The (path, value, exception) of every replacement whose parse raised a foreign error."""
    out = []
    for path in list(_paths(obj)):
        for value in BAD:
            try:
                parse(_text(_replaced(obj, path, value)))
            except DeltaError:
                pass
            except Exception as e:  # noqa: BLE001 (what this test looks for)
                out.append(f"{path} = {str(value)[:20]}: {type(e).__name__}: {e}"[:200])
    return out


@pytest.fixture(scope="module")
def delta(tmp_path_factory):
    """A block-indexed delta of two params (several blocks each) and a version-1 one."""
    out = {}
    for blocked in (True, False):
        path = tmp_path_factory.mktemp(f"d{int(blocked)}")
        g = torch.Generator().manual_seed(1)
        with DeltaWriter(
            path,
            version=1,
            base_version=0,
            encoding="ulp_zstd",
            blocked=blocked,
            block_policy=Policy(span_bits=6, min_entries=8, max_entries=16),
        ) as w:
            for name in ("a", "b"):
                old = torch.randn(256, generator=g).bfloat16()
                pos = torch.arange(0, 256, 5)
                w.add(
                    name, pos, (old[pos].view(torch.int16) + 1).view(torch.bfloat16), old[pos], shape=(256,)
                )
        out[blocked] = path
    return out


EXPECTED = {"a": ((256,), torch.bfloat16), "b": ((256,), torch.bfloat16)}


def test_manifest(delta):
    manifest = json.loads((delta[True] / "manifest.json").read_text())

    def parse(text: str) -> None:
        DeltaDecoder(parse_manifest(text.encode()), expected=EXPECTED, current_version=0)

    assert _escaped(manifest, parse) == []


def _decode(path, meta: dict, data_tensors: dict) -> None:
    """The flush re-packed with `meta`, listed in its manifest with its new size and hash, decoded."""
    data = pack(data_tensors, meta)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    dec = DeltaDecoder(parse_manifest(json.dumps(m).encode()), expected=EXPECTED, current_version=0)
    list(dec.feed_iter(FILE, data))
    dec.finish()


@pytest.mark.parametrize("blocked", [True, False], ids=["blocks", "v1"])
@pytest.mark.parametrize("key", ["streams", "params"])
def test_flush_metadata_json(delta, blocked, key):
    path = delta[blocked]
    raw, meta = unpack((path / FILE).read_bytes(), file=FILE, limits=Limits())
    tensors = {k: bytes(t.data) for k, t in raw.items()}
    value = json.loads(meta[key])
    assert _escaped(value, lambda text: _decode(path, {**meta, key: text}, tensors)) == []


def test_flush_metadata_strings(delta):
    """The header's plain values: each replaced by a mistyped value's JSON text."""
    path = delta[True]
    raw, meta = unpack((path / FILE).read_bytes(), file=FILE, limits=Limits())
    tensors = {k: bytes(t.data) for k, t in raw.items()}
    failures = []
    for key in ("format", "encoding", "current_version", "base_version"):
        for value in BAD:
            try:
                _decode(path, {**meta, key: _text(value)}, tensors)
            except DeltaError:
                pass
            except Exception as e:  # noqa: BLE001
                failures.append(f"{key} = {value!r}: {type(e).__name__}: {e}"[:200])
    assert failures == []


def test_safetensors_header(delta):
    data = (delta[True] / FILE).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]

    def parse(text: str) -> None:
        raw = text.encode()
        unpack(struct.pack("<Q", len(raw)) + raw + body, file=FILE, limits=Limits())

    assert _escaped(header, parse) == []


def test_seed_params():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    new[[1, 5, 40]] = 1.0
    data = seed_flush_bytes([("w", old, new)])
    tensors, meta, _ = open_flush(data, file=FILE, limits=Limits())
    meta["checksum"] = str(
        seed_checksum(tensors["__positions__"].data, tensors["__values__"].data, tensors["__values__"].dtype)
    )

    def parse(text: str) -> None:
        decode_seed_flush(
            tensors, {**meta, "params": text}, file=FILE, expected={"w": ((64,), torch.bfloat16)}
        )

    assert _escaped(json.loads(meta["params"]), parse) == []


def test_collective_offer(delta):
    """The offer rank 0 puts in the group's store, and the manifest's files it is checked against."""
    from vllm_delta.transports.collective import _check_offer, manifest_digest

    manifest = json.loads((delta[True] / "manifest.json").read_text())
    offer = {
        "manifest_sha256": manifest_digest(manifest),
        "version": 1,
        "flushes": [[f["name"], f["bytes"]] for f in manifest["files"]],
    }
    assert _check_offer(offer, manifest, 1, 1 << 30)

    def loads(text: str):
        """As the group's store hands it over; JSON nested past the parser's depth is its own error
        (transports/collective.answer answers it as a refusal)."""
        try:
            return json_loads(text)
        except ValueError:
            return None  # a value _check_offer refuses

    assert _escaped(offer, lambda text: _check_offer(loads(text), manifest, 1, 1 << 30)) == []
    files = manifest["files"]

    def with_files(text: str) -> None:
        _check_offer(offer, {**manifest, "files": loads(text)}, 1, 1 << 30)

    assert _escaped(files, with_files) == []
