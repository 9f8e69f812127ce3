"""Golden bytes: every flush layout and encoding against files committed once (tests/wire/golden/).

Why: a round trip only shows that our decoder reads our encoder's output, so an encoder and a
decoder changed together (a reversed byte-plane order, another index width) pass it unnoticed.
The golden files pin the bytes; a format change shows up here and needs a deliberate golden update
(`python tests/wire/golden/make_golden.py`, by hand, never by the suite).

Each case checks (a) that the encoder, given the fixed inputs below, reproduces the golden file, and
(b) that the reader decodes the golden file to the values written below as literals.

Our own flushes and manifests are compared byte for byte, whole: `container.pack` writes the
safetensors header with its `__metadata__` keys sorted, so the same delta gives the same bytes in
every process (and so the same file hash). The seed's layout is written by the test-side writer
(wire_helpers), through safetensors alone, which writes `__metadata__` from a hash map in an order
that differs per process; the seed's files are compared as (header length, header JSON, data
section), after decompression for whole-file zstd.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import zstandard
from wire_helpers import seed_flush_bytes

from vllm_delta.wire import ENCODINGS, DeltaWriter, read_delta
from vllm_delta.wire.blocks import Policy

GOLDEN = Path(__file__).parent / "golden"
FLUSH = "rank0000_flush000000.safetensors"
VERSION, BASE = 5, 4
POLICY = Policy(span_bits=16, min_entries=8, max_entries=8)  # small blocks, so `a` has three

OURS = ("indices", "deltas", "deltas_zstd", "planes_zstd", "ulp_zstd")
SEED = ("indices", "deltas", "deltas_zstd")
DENSE_ENCODINGS = ("indices", "deltas", "deltas_zstd", "planes_zstd")  # overwrite: what anchors use
CASES = (
    [(layout, e) for layout in ("v1", "v2") for e in OURS]
    + [("seed", e) for e in SEED]
    + [("v2dense", e) for e in DENSE_ENCODINGS]
)
FORMATS = {"v1": "vllm-delta/1", "v2": "vllm-delta/2", "v2dense": "vllm-delta/2"}

# name: dtype, shape, flat positions, old bits, new bits (unsigned bit patterns of the dtype).
# `a`: gaps of 0, exactly 2^16 - 1 and above 2^16 (u32 gaps); `b`: u16 gaps; `c`: u8 gaps;
# `huge` (2^33 elements, never allocated): positions either side of 2^31, a gap of exactly 2^32
# (u64 gaps, int64 indices). Values have distinct high and low bytes, so a plane order shows.
PARAMS = {
    "a": (
        torch.bfloat16,
        (3, 100_000),
        [
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            300,
            65_535,
            65_536,
            65_537,
            70_000,
            135_536,
            135_537,
            250_000,
            250_001,
            260_000,
            299_998,
            299_999,
        ],
        [
            0x3F80,
            0xBF80,
            0x0000,
            0x8000,
            0x3C23,
            0x4049,
            0x7F7F,
            0x3F80,
            0x7FC0,
            0x0001,
            0x1234,
            0xA5C3,
            0x3E4C,
            0xC2F7,
            0x4B1D,
            0x3A5E,
            0xFF80,
            0x00FF,
            0x5A01,
            0x3F80,
        ],
        [
            0x3F81,
            0xBF81,
            0x8000,
            0x0000,
            0x3C21,
            0x404C,
            0x7F80,
            0xC000,
            0x7FC1,
            0x0002,
            0x1236,
            0xA5C2,
            0x3E4B,
            0xC2F8,
            0x4B1C,
            0x3A62,
            0xFF7F,
            0x0100,
            0x59FF,
            0x3F00,
        ],
    ),
    "b": (
        torch.float32,
        (8, 64),
        [1, 3, 300, 400, 511],
        [0x3F800000, 0xBF800000, 0x00000001, 0x7F7FFFFF, 0x12345678],
        [0x3F800001, 0xBF7FFFFF, 0x80000000, 0x7F800000, 0x12345680],
    ),
    "c": (torch.float16, (16,), [0, 5, 15], [0x3C00, 0x0000, 0xFBFF], [0x3C01, 0x0001, 0xFC00]),
    "huge": (
        torch.bfloat16,
        (1 << 17, 1 << 16),
        [0, (1 << 31) - 1, 1 << 31, (1 << 31) + (1 << 32) + 1, (1 << 33) - 1],
        [0x3F80, 0x4000, 0xBF80, 0x0001, 0x7F7F],
        [0x3F81, 0x3FFF, 0xBF7F, 0x0003, 0xFF80],
    ),
}
SEED_PARAMS = ("a", "b", "c")  # the seed's writer diffs whole tensors: no `huge`
# ulp_zstd's signed steps key(new) - key(old) mod 2^bits, worked out by hand from the bits above.
STEPS = {
    "a": [1, -1, -1, 1, -2, 3, 1, -32641, 1, 1, 2, 1, -1, -1, -1, 4, 1, 1, -2, -128],
    "b": [1, 1, -2, 1, 8],
    "c": [1, 1, -1],
    "huge": [1, -1, 1, 2, 256],
}
WIDTHS = {
    "indices": {"a": 4, "b": 4, "c": 4, "huge": 8},
    "gaps": {"a": 4, "b": 2, "c": 1, "huge": 8},
    "seed_deltas": {"a": 4, "b": 2, "c": 2},
}  # the seed's writer never goes below u16
BLOCKS = {
    "a": [[0, 7, 8], [300, 250_000, 8], [250_001, 299_999, 4]],
    "b": [[1, 511, 5]],
    "c": [[0, 15, 3]],
    "huge": [[0, (1 << 33) - 1, 5]],
}

# Implicit positions (width 0), written by `add_dense` from pieces `(start, length)`: `w` whole, in two
# pieces that merge into one run, cut where positions cross a multiple of 8 (POLICY.max_entries);
# `s` a column slice (runs of 3: block counts need not be multiples of 8); `huge` (2^33 elements,
# never allocated) a run across 2^31 and one ending at the last element.
DENSE = {
    "w": (torch.bfloat16, (3, 7), [(0, 10), (10, 11)]),
    "s": (torch.float32, (4, 6), [(1, 3), (7, 3), (13, 3), (19, 3)]),
    "huge": (torch.bfloat16, (1 << 17, 1 << 16), [((1 << 31) - 5, 11), ((1 << 33) - 2, 2)]),
}
DENSE_BLOCKS = {
    "w": [[0, 7, 8], [8, 15, 8], [16, 20, 5]],
    "s": [[1, 3, 3], [7, 7, 1], [8, 9, 2], [13, 15, 3], [19, 21, 3]],
    "huge": [
        [(1 << 31) - 5, (1 << 31) - 1, 5],
        [1 << 31, (1 << 31) + 5, 6],
        [(1 << 33) - 2, (1 << 33) - 1, 2],
    ],
}


def dense_positions(name: str) -> list[int]:
    return [p for a, n in DENSE[name][2] for p in range(a, a + n)]


def dense_bits(name: str) -> list[int]:
    """Distinct high and low bytes per element, so a plane order shows."""
    w = 8 * DENSE[name][0].itemsize
    return [(0x12345679 * (i + 1) >> 3) & ((1 << w) - 1) for i in range(len(dense_positions(name)))]


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_tensor(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding the given unsigned bit patterns."""
    w = 8 * dtype.itemsize
    signed = [b - (1 << w) if b >> (w - 1) else b for b in bits]
    return torch.tensor(signed, dtype=_INT[dtype.itemsize]).view(dtype)


def unsigned(t: torch.Tensor) -> list[int]:
    mask = (1 << 8 * t.element_size()) - 1
    return [v & mask for v in t.reshape(-1).view(_INT[t.element_size()]).tolist()]


def case_dir(layout: str, encoding: str) -> str:
    return f"{layout}_{encoding}"


def write_ours(out: Path, layout: str, encoding: str) -> None:
    """The fixed inputs through the public writer: one flush, `vllm-delta/1` or `/2`."""
    if layout == "v2dense":
        with DeltaWriter(
            out, version=VERSION, base_version=BASE, encoding=encoding, block_policy=POLICY
        ) as w:
            for name, (dtype, shape, pieces) in DENSE.items():
                values, at = bits_tensor(dense_bits(name), dtype), 0
                w.add_dense(name, [(a, values[at : (at := at + n)]) for a, n in pieces], shape=shape)
        return
    with DeltaWriter(
        out,
        version=VERSION,
        base_version=BASE,
        encoding=encoding,
        blocked=layout == "v2",
        block_policy=POLICY,
    ) as w:
        for name, (dtype, shape, pos, old, new) in PARAMS.items():
            w.add(
                name,
                torch.tensor(pos, dtype=torch.int64),
                bits_tensor(new, dtype),
                bits_tensor(old, dtype),
                shape=shape,
            )


def seed_bytes(encoding: str) -> bytes:
    """The fixed inputs through the test-side writer of the seed's layout (bf16, fp16 and fp32
    values concatenate as fp32, as the seed's did)."""
    changes = []
    for name in SEED_PARAMS:
        dtype, shape, pos, old, new = PARAMS[name]
        full_old, full_new = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        full_old.view(-1)[pos] = bits_tensor(old, dtype)
        full_new.view(-1)[pos] = bits_tensor(new, dtype)
        changes.append((name, full_old, full_new))
    return seed_flush_bytes(changes, encoding=encoding, version=VERSION)


def container_parts(data: bytes) -> tuple[int, dict, bytes]:
    """(header length, header JSON, data section) of a safetensors file, after whole-file zstd."""
    if data[:4] == b"\x28\xb5\x2f\xfd":
        data = zstandard.ZstdDecompressor().decompress(data)
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def test_every_encoding_has_golden_files():
    assert set(OURS) == set(ENCODINGS)
    for layout, encoding in CASES:
        assert (GOLDEN / case_dir(layout, encoding) / FLUSH).is_file()


@pytest.mark.parametrize("layout,encoding", CASES)
def test_encoder_reproduces_the_golden_file(tmp_path, layout, encoding):
    golden = GOLDEN / case_dir(layout, encoding)
    want = (golden / FLUSH).read_bytes()
    assert (want[:4] == b"\x28\xb5\x2f\xfd") == (encoding == "deltas_zstd" and layout in ("v1", "seed"))
    if layout == "seed":
        assert container_parts(seed_bytes(encoding)) == container_parts(want)
        return
    write_ours(tmp_path / "d", layout, encoding)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["manifest.json", FLUSH]
    assert (tmp_path / "d" / "manifest.json").read_bytes() == (golden / "manifest.json").read_bytes()
    assert (tmp_path / "d" / FLUSH).read_bytes() == want


@pytest.mark.parametrize("layout,encoding", [c for c in CASES if c[0] in ("v1", "v2")])
def test_golden_header_states_the_widths_and_blocks(layout, encoding):
    _, header, _ = container_parts((GOLDEN / case_dir(layout, encoding) / FLUSH).read_bytes())
    meta = header["__metadata__"]
    assert (meta["format"], meta["encoding"], meta["current_version"], meta["base_version"]) == (
        FORMATS[layout],
        encoding,
        str(VERSION),
        str(BASE),
    )
    params = json.loads(meta["params"])
    widths = WIDTHS["indices" if encoding == "indices" else "gaps"]
    assert {p["name"]: p["width"] for p in params} == widths
    assert [p["count"] for p in params] == [len(PARAMS[n][2]) for n in PARAMS]
    if layout == "v2":
        assert {p["name"]: [r[:3] for r in p["blocks"]] for p in params} == BLOCKS


@pytest.mark.parametrize("layout,encoding", [c for c in CASES if c[0] != "v2dense"])
def test_decoder_reads_the_golden_file_to_the_known_values(layout, encoding):
    names = SEED_PARAMS if layout == "seed" else tuple(PARAMS)
    expected = {n: (PARAMS[n][1], PARAMS[n][0]) for n in names}
    deltas = read_delta(
        GOLDEN / case_dir(layout, encoding), expected=expected, current_version=BASE, allow_seed=True
    )
    assert [pd.name for pd in deltas] == list(names)
    for pd in deltas:
        dtype, shape, pos, old, new = PARAMS[pd.name]
        assert (pd.dtype, pd.shape, pd.positions.dtype) == (dtype, shape, torch.int64)
        assert pd.positions.tolist() == pos
        if encoding == "ulp_zstd":
            assert pd.needs_base and pd.values.tolist() == STEPS[pd.name]
            assert unsigned(pd.resolve(bits_tensor(old, dtype))) == new
        else:
            assert not pd.needs_base and unsigned(pd.values) == new


def test_seed_golden_files_state_the_seed_widths():
    for encoding in SEED:
        _, header, _ = container_parts((GOLDEN / case_dir("seed", encoding) / FLUSH).read_bytes())
        params = json.loads(header["__metadata__"]["params"])
        want = WIDTHS["seed_deltas"] if encoding != "indices" else {n: 4 for n in SEED_PARAMS}
        assert {p["name"]: p["pos_width"] for p in params} == want
        assert header["__values__"]["dtype"] == "F32"  # mixed dtypes: promoted, as the seed did


@pytest.mark.parametrize("encoding", OURS)
def test_golden_block_index_lets_a_reader_decode_one_block(encoding):
    owned = {"a": [(65_536, 65_536)], "b": [], "c": None}  # `huge` unlisted: all of it
    deltas = {
        pd.name: pd for pd in read_delta(GOLDEN / case_dir("v2", encoding), current_version=BASE, owned=owned)
    }
    a, b, c, huge = (deltas[n] for n in PARAMS)
    assert (a.blocks, b.blocks, c.blocks, huge.blocks) == ((1, 3), (0, 1), (1, 1), (1, 1))
    assert a.positions.tolist() == PARAMS["a"][2][8:16] and (a.skipped, b.skipped) == (12, 5)
    if encoding == "ulp_zstd":
        assert a.values.tolist() == STEPS["a"][8:16]
    else:
        assert unsigned(a.values) == PARAMS["a"][4][8:16]


@pytest.mark.parametrize("encoding", DENSE_ENCODINGS)
def test_dense_golden_header_has_implicit_positions(encoding):
    _, header, _ = container_parts((GOLDEN / case_dir("v2dense", encoding) / FLUSH).read_bytes())
    meta = header["__metadata__"]
    assert (meta["format"], meta["encoding"]) == ("vllm-delta/2", encoding)
    params = json.loads(meta["params"])
    assert [p["name"] for p in params] == list(DENSE)
    assert {p["name"]: p["width"] for p in params} == {n: 0 for n in DENSE}
    assert {p["name"]: [r[:3] for r in p["blocks"]] for p in params} == DENSE_BLOCKS
    values = {"indices": ["values"], "deltas": ["values"], "deltas_zstd": ["values"], "planes_zstd": None}[
        encoding
    ]
    for p in params:  # no position stream: only the values'
        assert p["streams"] == (values or [f"val{j}" for j in range(DENSE[p["name"]][0].itemsize)])


@pytest.mark.parametrize("encoding", DENSE_ENCODINGS)
def test_dense_golden_decodes_to_the_known_positions_and_values(encoding):
    expected = {n: (shape, dtype) for n, (dtype, shape, _) in DENSE.items()}
    deltas = read_delta(GOLDEN / case_dir("v2dense", encoding), expected=expected)
    assert [pd.name for pd in deltas] == list(DENSE)
    for pd in deltas:
        assert pd.positions.dtype == torch.int64 and pd.positions.tolist() == dense_positions(pd.name)
        assert not pd.needs_base and unsigned(pd.values) == dense_bits(pd.name)


@pytest.mark.parametrize("encoding", DENSE_ENCODINGS)
def test_dense_golden_block_index_lets_a_reader_decode_one_block(encoding):
    owned = {"w": [(9, 9)], "s": [(13, 13), (21, 21)], "huge": [(1 << 31, 1 << 31)]}
    deltas = {pd.name: pd for pd in read_delta(GOLDEN / case_dir("v2dense", encoding), owned=owned)}
    w, s, huge = (deltas[n] for n in DENSE)
    assert (w.blocks, s.blocks, huge.blocks) == ((1, 3), (2, 5), (1, 3))
    assert w.positions.tolist() == list(range(8, 16)) and unsigned(w.values) == dense_bits("w")[8:16]
    assert s.positions.tolist() == [13, 14, 15, 19, 20, 21] and unsigned(s.values) == dense_bits("s")[6:]
    assert huge.positions.tolist() == list(range(1 << 31, (1 << 31) + 6)) and huge.skipped == 7
