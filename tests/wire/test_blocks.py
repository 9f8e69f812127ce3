"""Block-indexed flushes (`vllm-delta/2`): exact round trips, skipping what a reader does not own,
reading `vllm-delta/1` files, and refusing an index that disagrees with the data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vllm_delta.wire import (
    ENCODINGS,
    BoundsError,
    DeltaDecoder,
    Manifest,
    ParamChange,
    ParamEntry,
    encode_flush,
    file_entry,
    get_encoding,
)
from vllm_delta.wire.blocks import Policy, cuts
from vllm_delta.wire.container import Limits, pack, unpack

SMALL = Policy(span_bits=8, min_entries=16, max_entries=64)  # many blocks in a small tensor
NUMEL = 4096


def change(seed: int = 0, density: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    pos = torch.nonzero(torch.rand(NUMEL, generator=g) < density).squeeze(1)
    old = torch.randn(pos.numel(), generator=g).bfloat16()
    new = (old.float() + torch.randn(pos.numel(), generator=g) * 0.01).bfloat16()
    same = new.view(torch.int16) == old.view(torch.int16)
    new.view(torch.int16)[same] += 1  # base-relative encodings need every value to move
    return ParamChange("w", (64, 64), pos, new, old)


def decode(ch: ParamChange, encoding: str, *, blocked: bool = True, owned=None, data: bytes | None = None):
    flush = encode_flush(
        [ch], encoding=get_encoding(encoding), version=1, base_version=0, blocked=blocked, policy=SMALL
    )
    data = data if data is not None else flush.data
    m = Manifest(
        version=1,
        base_version=0,
        encoding=encoding,
        files=[
            file_entry("f", flush).model_copy(update={"bytes": len(data)})
            if data is not flush.data
            else file_entry("f", flush)
        ],
        params=[
            ParamEntry(name="w", dtype="bfloat16", shape=[64, 64], changed=ch.positions.numel(), files=["f"])
        ],
    )
    if data is not flush.data:
        from vllm_delta.wire import bytes_digest

        m = m.model_copy(update={"files": [m.files[0].model_copy(update={"hash": bytes_digest(data)})]})
    dec = DeltaDecoder(m, current_version=0)
    (pd,) = dec.feed("f", data, owned=owned)
    dec.finish()
    return flush, pd


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("blocked", [True, False], ids=["v2", "v1"])
@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_round_trip_over_many_blocks(encoding, blocked):
    ch = change()
    flush, pd = decode(ch, encoding, blocked=blocked)
    meta = unpack(flush.data, file="f", limits=Limits())[1] if blocked else None
    if blocked:
        assert meta["format"] == "vllm-delta/2" and len(json.loads(meta["params"])[0]["blocks"]) > 8
    assert torch.equal(pd.positions, ch.positions)
    assert torch.equal(bits(pd.resolve(ch.old_values)), bits(ch.new_values))
    assert pd.skipped == 0


@pytest.mark.parametrize("encoding", ["ulp_zstd", "deltas_zstd", "indices", "planes_zstd"])
def test_a_reader_decodes_only_blocks_meeting_what_it_owns(encoding):
    ch = change(seed=1)
    owned = [(1000, 1999), (3000, 3100)]
    _, pd = decode(ch, encoding, owned={"w": owned[::-1]})  # in any order
    decoded, indexed = pd.blocks
    assert 0 < decoded < indexed
    assert pd.count < ch.positions.numel() and pd.total == ch.positions.numel()
    inside = torch.zeros_like(ch.positions, dtype=torch.bool)
    for a, b in owned:
        inside |= (ch.positions >= a) & (ch.positions <= b)
    got = set(pd.positions.tolist())
    assert (
        set(ch.positions[inside].tolist()) <= got <= set(ch.positions.tolist())
    )  # all it owns, no invention
    keep = torch.isin(ch.positions, pd.positions)
    assert torch.equal(bits(pd.resolve(ch.old_values[keep])), bits(ch.new_values[keep]))
    assert (pd.first, pd.last) == (int(ch.positions[0]), int(ch.positions[-1]))


def test_a_reader_owning_nothing_decodes_nothing_and_still_counts():
    ch = change(seed=2)
    _, pd = decode(ch, "ulp_zstd", owned={"w": []})
    assert pd.count == 0 and pd.blocks[0] == 0 and pd.total == ch.positions.numel()


def test_block_cuts_align_to_windows_in_multiples_of_8():
    pos = np.sort(np.random.default_rng(0).choice(1 << 22, size=200_000, replace=False)).astype(np.int64)
    starts = cuts(pos)
    counts = np.diff([*starts, pos.size])
    assert starts[0] == 0 and all(c % 8 == 0 for c in counts[:-1]) and counts.max() <= Policy().max_entries
    assert min(counts[:-1]) >= Policy().min_entries
    # 4 windows of 2^20 positions, 50k entries each (below the cap): one block per window, each
    # starting within 8 entries of its window's start.
    assert [int(pos[c + 8] >> 20) for c in starts] == [0, 1, 2, 3]


def test_an_index_that_misplaces_a_block_is_refused():
    ch = change(seed=3)
    flush = encode_flush([ch], encoding=get_encoding("ulp_zstd"), version=1, base_version=0, policy=SMALL)
    tensors, meta = unpack(flush.data, file="f", limits=Limits())
    params = json.loads(meta["params"])
    block = params[0]["blocks"][2]
    block[0] -= 1  # still sorted and disjoint, but not where the block's first change is
    assert block[0] > params[0]["blocks"][1][1]
    data = pack({k: bytes(t.data) for k, t in tensors.items()}, dict(meta, params=json.dumps(params)))
    with pytest.raises(BoundsError, match="block index") as e:
        decode(ch, "ulp_zstd", data=data)
    assert e.value.param == "w"
