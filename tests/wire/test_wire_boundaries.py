"""Index and gap widths at the edges where they change: 2^8, 2^16, 2^31 and 2^32.

Why: positions wider than int32, or gaps wider than u16, appear only in tensors of billions of
elements, which no round trip of real tensors reaches; an encoder that picks int32 (or u16) one
step too long wraps silently. The writer and reader take a `shape=` and positions, so these
tensors are described, never allocated. Widths are read from the flush header's JSON directly
(not through the reader) and compared with the documented rule: int32 indices while every position
fits (at most 2^31 elements), else int64; gaps in the narrowest of u8/u16/u32/u64 that holds them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
import zstandard

from vllm_delta.wire import DeltaWriter, read_delta
from vllm_delta.wire.blocks import Policy

FLUSH = "rank0000_flush000000.safetensors"
GAP_ENCODINGS = ("deltas", "deltas_zstd", "planes_zstd", "ulp_zstd")
LAYOUTS = {"v1": False, "v2": True}
EDGES = (0, (1 << 31) - 2, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 32) - 1, 1 << 32, (1 << 32) + 1)


def write(
    path: Path,
    shape: tuple[int, ...],
    positions: list[int],
    *,
    encoding: str,
    blocked: bool,
    policy: Policy = Policy(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One param `w` (bf16) changed at `positions`: every value moves up one bit pattern."""
    n = len(positions)
    old = (torch.arange(n, dtype=torch.int16) * 7 + 0x3F00).view(torch.bfloat16)
    new = (old.view(torch.int16) + 1).view(torch.bfloat16)
    with DeltaWriter(
        path, version=1, base_version=0, encoding=encoding, blocked=blocked, block_policy=policy
    ) as w:
        w.add("w", torch.tensor(positions, dtype=torch.int64), new, old, shape=shape)
    return old, new


def header_param(path: Path) -> dict:
    """The flush metadata's entry for `w`, parsed from the safetensors bytes by hand."""
    data = (path / FLUSH).read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":
        data = zstandard.ZstdDecompressor().decompress(data)
    (n,) = struct.unpack("<Q", data[:8])
    (p,) = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["params"])
    return p


def read_back(path: Path, old: torch.Tensor, **kw):
    """The one decoded param and its new values (base-relative steps resolved against `old`)."""
    (pd,) = read_delta(path, current_version=0, **kw)
    assert pd.positions.dtype == torch.int64
    return pd, pd.resolve(old) if pd.needs_base else pd.values


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "numel,width",
    [
        ((1 << 31) - 1, 4),
        (1 << 31, 4),
        ((1 << 31) + 1, 8),
        (1 << 32, 8),
        ((1 << 32) + 1, 8),
        ((1 << 32) + 2, 8),
    ],
)
def test_index_width_switches_to_int64_past_2_pow_31_elements(tmp_path, layout, numel, width):
    positions = sorted({p for p in EDGES if p < numel} | {numel - 1})
    shape = (numel,) if numel % 2 else (2, numel // 2)
    old, new = write(tmp_path / "d", shape, positions, encoding="indices", blocked=LAYOUTS[layout])
    assert header_param(tmp_path / "d")["width"] == width
    pd, values = read_back(tmp_path / "d", old)
    assert pd.positions.tolist() == positions and pd.shape == shape
    assert torch.equal(values.view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("encoding", GAP_ENCODINGS)
@pytest.mark.parametrize(
    "gap,width", [(255, 1), (256, 2), ((1 << 16) - 1, 2), (1 << 16, 4), ((1 << 32) - 1, 4), (1 << 32, 8)]
)
def test_gap_width_is_the_narrowest_that_holds_the_largest_gap(tmp_path, layout, encoding, gap, width):
    # First position `gap` (a gap from -1), then one of gap 0 and one of `gap` again.
    positions = [gap, gap + 1, 2 * gap + 2]
    old, new = write(
        tmp_path / "d", (1 << 17, 1 << 17), positions, encoding=encoding, blocked=LAYOUTS[layout]
    )
    assert header_param(tmp_path / "d")["width"] == width
    pd, values = read_back(tmp_path / "d", old)
    assert pd.positions.tolist() == positions
    assert torch.equal(values.view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("encoding", ("indices", *GAP_ENCODINGS))
def test_blocks_past_2_pow_32_share_one_width_and_are_found_by_owned_ranges(tmp_path, encoding):
    # 8 small gaps, then 8 positions each 2^32 + 5 apart: blocks of 8, so the first block alone
    # would fit u8 gaps; the param's one width must be the widest (u64).
    positions = list(range(8)) + [7 + k * ((1 << 32) + 5) for k in range(1, 9)]
    shape = (1 << 18, 1 << 18)  # 2^36 elements
    old, new = write(
        tmp_path / "d",
        shape,
        positions,
        encoding=encoding,
        blocked=True,
        policy=Policy(span_bits=20, min_entries=8, max_entries=8),
    )
    p = header_param(tmp_path / "d")
    assert p["width"] == 8 and [r[:3] for r in p["blocks"]] == [[0, 7, 8], [positions[8], positions[15], 8]]
    pd, values = read_back(tmp_path / "d", old)
    assert pd.positions.tolist() == positions
    assert torch.equal(values.view(torch.int16), new.view(torch.int16))
    far = positions[12]
    (pd,) = read_delta(tmp_path / "d", current_version=0, owned={"w": [(far, far)]})
    assert pd.blocks == (1, 2) and pd.positions.tolist() == positions[8:]


def seed_flush(
    positions_blob: bytes, values: torch.Tensor, *, encoding: str, shape: list[int], width: int
) -> bytes:
    """A seed-layout flush written field by field (docs/wire-format.md, "Seed format")."""
    pos = torch.frombuffer(bytearray(positions_blob), dtype=torch.uint8)
    checksum = torch.hash_tensor(pos).item() ^ ((torch.hash_tensor(values).item() << 1) & ((1 << 64) - 1))
    params = [
        {
            "name": "w",
            "dtype": "torch.bfloat16",
            "shape": shape,
            "pos_start": 0,
            "pos_end": len(positions_blob),
            "pos_width": width,
            "val_start": 0,
            "val_end": values.numel(),
        }
    ]
    return safetensors.torch.save(
        {"__positions__": pos, "__values__": values},
        metadata={
            "encoding": encoding,
            "params": json.dumps(params),
            "current_version": "3",
            "checksum": str(checksum),
        },
    )


@pytest.mark.parametrize(
    "encoding,width,blob",
    [
        ("indices", 8, struct.pack("<4q", 5, (1 << 31) - 1, 1 << 31, (1 << 32) + 1)),
        ("deltas", 8, struct.pack("<4Q", 5, (1 << 31) - 7, 0, (1 << 31))),  # gaps of the same positions
    ],
    ids=["indices", "deltas"],
)
def test_seed_reader_takes_64_bit_positions_past_2_pow_31(tmp_path, encoding, width, blob):
    values = torch.tensor([0x3F80, 0x3F81, 0x3F82, 0x3F83], dtype=torch.int16).view(torch.bfloat16)
    (tmp_path / FLUSH).write_bytes(
        seed_flush(blob, values, encoding=encoding, shape=[1 << 17, 1 << 16], width=width)
    )
    (pd,) = read_delta(tmp_path, allow_seed=True)
    assert pd.positions.tolist() == [5, (1 << 31) - 1, 1 << 31, (1 << 32) + 1]
    assert pd.values.view(torch.int16).tolist() == [0x3F80, 0x3F81, 0x3F82, 0x3F83]
