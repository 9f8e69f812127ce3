"""Implicit positions (width 0, `FlushBuilder.add_dense`): dense ranges streamed into flushes as they
fill, read back exactly, and an index that claims implicit positions it does not have refused."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_delta.wire import (
    BoundsError,
    DeltaDecoder,
    FlushBuilder,
    FormatError,
    Manifest,
    ParamChange,
    ParamEntry,
    encode_flush,
    file_entry,
    get_encoding,
)
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import Limits, pack, unpack

OVERWRITE = ("indices", "deltas", "deltas_zstd", "planes_zstd")
SMALL = Policy(span_bits=8, min_entries=16, max_entries=64)


def build(encoding: str, flush_bytes: int, adds, *, blocked: bool = True):
    """Run `adds(builder)`; the emitted flushes (name, bytes) and the manifest."""
    out: list[tuple[str, bytes]] = []
    b = FlushBuilder(
        lambda name, f: out.append((name, f.data)),
        version=1,
        encoding=encoding,
        flush_bytes=flush_bytes,
        blocked=blocked,
        block_policy=SMALL,
    )
    adds(b)
    return out, b.manifest()


def decode_all(flushes, manifest, owned=None):
    dec = DeltaDecoder(manifest)
    got = [pd for name, data in flushes for pd in dec.feed(name, data, owned=owned)]
    dec.finish()
    return got


def scattered(shape, deltas, name) -> torch.Tensor:
    """The decoded changes of `name` written into zeros (a reference of plain torch indexing)."""
    dtype = next(pd.dtype for pd in deltas if pd.name == name)
    out = torch.zeros(shape, dtype=dtype).view(-1)
    for pd in deltas:
        if pd.name == name:
            out[pd.positions] = pd.values
    return out


@pytest.mark.parametrize("blocked", [True, False], ids=["v2", "v1"])
@pytest.mark.parametrize("encoding", OVERWRITE)
def test_dense_pieces_round_trip_across_flushes(encoding, blocked):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(40, 50, generator=g).bfloat16()  # 4000 B of values: several 1000 B flushes
    col = torch.randn(6, 10, generator=g)  # a column slice [:, 2:5] as runs of 3 (not multiples of 8)
    pieces_big = [
        (0, big.view(-1)[:700]),
        (700, big.view(-1)[700:701]),
        (701, big.view(-1)[701:1499]),
        (1503, big.view(-1)[1503:]),
    ]  # a hole at 1499..1502

    def adds(b):
        b.add_dense("big", iter(pieces_big), shape=big.shape)
        b.add("x", torch.tensor([0, 7]), torch.tensor([1.0, 2.0]), shape=(8,))
        b.add_dense("col", ((r * 10 + 2, col[r, 2:5]) for r in range(6)), shape=col.shape)

    flushes, manifest = build(encoding, 1000, adds, blocked=blocked)
    assert len(flushes) >= 4
    deltas = decode_all(flushes, manifest)
    want = big.clone().view(-1)
    want[1499:1503] = 0
    assert torch.equal(scattered(big.shape, deltas, "big").view(torch.int16), want.view(torch.int16))
    assert sum(pd.count for pd in deltas if pd.name == "big") == big.numel() - 4
    want_col = torch.zeros_like(col)
    want_col[:, 2:5] = col[:, 2:5]
    assert torch.equal(
        scattered(col.shape, deltas, "col").view(torch.int32), want_col.view(-1).view(torch.int32)
    )
    assert {p.name: p.changed for p in manifest.params} == {"big": big.numel() - 4, "x": 2, "col": 18}
    if blocked:
        for _, data in flushes:
            params = json.loads(unpack(data, file="f", limits=Limits())[1]["params"])
            assert all(p["width"] == 0 for p in params if p["name"] != "x")
            for p in params:  # a flush holds at most flush_bytes of values (explicit: 8 + 2 B per change)
                assert p["count"] * (2 if p["name"] == "big" else 4) <= 1000


def test_dense_ranges_by_owned_blocks_only():
    t = torch.arange(1000, dtype=torch.float32)
    flushes, manifest = build("planes_zstd", 1 << 20, lambda b: b.add_dense("t", [(0, t)], shape=t.shape))
    (pd,) = decode_all(flushes, manifest, owned={"t": [(130, 130), (900, 999)]})
    assert pd.blocks == (3, 16) and pd.skipped == 1000 - 168  # blocks 128..191, 896..959, 960..999
    assert pd.positions.tolist() == list(range(128, 192)) + list(range(896, 1000))
    assert torch.equal(pd.values, t[pd.positions])


def test_add_dense_refuses_what_it_cannot_write_exactly():
    v = torch.ones(4)
    for bad, match in [
        ([(2, v), (4, v)], "overlaps"),
        ([(0, v), (8, v)], "leaves"),
        ([(0, v), (4, v.double())], "one dtype"),
        ([(0, v.view(2, 2))], "1-D"),
    ]:
        with pytest.raises(ValueError, match=match):
            build("planes_zstd", 1 << 20, lambda b, bad=bad: b.add_dense("w", bad, shape=(10,)))
    b = FlushBuilder(lambda n, f: None, version=2, base_version=1, encoding="ulp_zstd")
    with pytest.raises(ValueError, match="base-relative"):
        b.add_dense("w", [(0, v)], shape=(4,))


def _flush_with(params_edit, *, fmt: str | None = None):
    """A one-param dense flush whose metadata `params_edit` changes, and a manifest for it."""
    t = torch.arange(84, dtype=torch.float32)  # blocks [0, 63] and [80, 99]
    flush = encode_flush(
        [ParamChange("t", (100,), None, t, ranges=((0, 64), (80, 20)))],
        encoding=get_encoding("deltas"),
        version=1,
        base_version=None,
        policy=SMALL,
    )
    tensors, meta = unpack(flush.data, file="f", limits=Limits())
    params = json.loads(meta["params"])
    params_edit(params[0])
    meta = dict(meta, params=json.dumps(params), **({"format": fmt} if fmt else {}))
    data = pack({k: bytes(t.data) for k, t in tensors.items()}, meta)
    entry = file_entry("f", flush).model_copy(update={"bytes": len(data)})
    from vllm_delta.wire import bytes_digest

    m = Manifest(
        version=1,
        encoding="deltas",
        files=[entry.model_copy(update={"hash": bytes_digest(data)})],
        params=[ParamEntry(name="t", dtype="float32", shape=[100], changed=84, files=["f"])],
    )
    return m, data


def test_an_index_claiming_a_dense_block_it_is_not_is_refused():
    def sparse_block(p):  # block 1 says 20 changes in 70..99: not dense
        p["blocks"][1][0] = 70

    m, data = _flush_with(sparse_block)
    with pytest.raises(BoundsError, match="not dense"):
        DeltaDecoder(m).feed("f", data)


def test_implicit_positions_are_refused_where_the_format_has_none():
    m, data = _flush_with(lambda p: None)
    (pd,) = DeltaDecoder(m).feed("f", data)  # the flush untouched reads
    assert pd.positions.tolist() == list(range(64)) + list(range(80, 100))

    def as_v1(p):  # width 0 in a `vllm-delta/1` param: no gap width 0, and no position stream
        p["spans"] = {"values": [0, 336]}
        del p["streams"], p["blocks"]

    m, data = _flush_with(as_v1, fmt="vllm-delta/1")
    with pytest.raises(FormatError):
        DeltaDecoder(m).feed("f", data)


def test_a_dense_block_with_missing_value_bytes_is_refused():
    def short(p):  # block 1 (20 values, 80 B) claims 76 B
        p["blocks"][1][3] = [76, 76]

    m, data = _flush_with(short)
    with pytest.raises(FormatError):
        DeltaDecoder(m).feed("f", data)
