"""The scan on tensors that span several diff chunks, with changes on the chunk edges (the first and
last element of each chunk), against a plain-torch reference: the positions where the bit patterns
differ, `torch.nonzero(a.view(int16) != b.view(int16))`.

Why: the host diff compares in chunks and shifts each chunk's hits by its offset; a tensor of one
chunk cannot tell a dropped or wrong offset from a right one. The chunk is shrunk (the module
constant, read at call time) so that a small tensor spans many chunks, and one test runs at the
real chunk size."""

from __future__ import annotations

import pytest
import torch

from vllm_delta import diff
from vllm_delta.sender import Shard
from vllm_delta.sender.producer import Producer

SMALL_CHUNK = 768


def _reference(cur: torch.Tensor, snap: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(cur.reshape(-1).view(torch.int16) != snap.reshape(-1).view(torch.int16)).reshape(-1)


def _edges(chunk: int, n: int) -> list[int]:
    """The first and the last element of every chunk of an `n`-element tensor."""
    return sorted({p for a in range(0, n, chunk) for p in (a, min(a + chunk, n) - 1)})


def _with_changes(base: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """`base` with the lowest mantissa bit flipped at `positions` (a one-ULP change)."""
    out = base.clone()
    out.reshape(-1).view(torch.int16)[torch.tensor(positions)] ^= 1
    return out


def _base(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("n", [12 * SMALL_CHUNK, 12 * SMALL_CHUNK + 5])  # a full last chunk, and a short one
@pytest.mark.parametrize("which", ["first", "last", "both"])
def test_changes_on_chunk_edges(monkeypatch, n: int, which: str) -> None:
    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", SMALL_CHUNK)
    edges = _edges(SMALL_CHUNK, n)
    pick = {"first": edges[0::2], "last": edges[1::2], "both": edges}[which]
    snap = _base(n)
    cur = _with_changes(snap, pick)
    got = diff.changed_positions(cur, snap)
    assert torch.equal(got, _reference(cur, snap))
    assert got.tolist() == pick
    d = diff.diff_param(cur, snap)
    assert torch.equal(d.new_values.view(torch.int16), cur.view(torch.int16)[pick])
    assert torch.equal(d.old_values.view(torch.int16), snap.view(torch.int16)[pick])


def test_scattered_changes_over_many_chunks(monkeypatch) -> None:
    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", SMALL_CHUNK)
    n = 40 * SMALL_CHUNK + 123
    gen = torch.Generator().manual_seed(1)
    pick = sorted(
        set(torch.randint(0, n, (n // 50,), generator=gen).tolist()) | set(_edges(SMALL_CHUNK, n)[::3])
    )
    snap = _base(n, seed=2)
    cur = _with_changes(snap, pick)
    assert torch.equal(diff.changed_positions(cur, snap), _reference(cur, snap))
    assert torch.equal(diff.changed_positions(snap, snap), torch.zeros(0, dtype=torch.int64))


def test_at_the_real_chunk_size() -> None:
    """Just over one real chunk (4M elements, 8 MB of bf16): the edges of both chunks."""
    c = diff.CHUNK_ELEMENTS
    n = c + 3
    pick = [0, 1, c - 1, c, c + 2]
    snap = _base(n, seed=3)
    cur = _with_changes(snap, pick)
    got = diff.changed_positions(cur, snap)
    assert torch.equal(got, _reference(cur, snap)) and got.tolist() == pick


def test_producer_scan_of_a_row_shard_over_chunk_edges(monkeypatch) -> None:
    """A TP row slice, rows 3.. of the full tensor: each shipped position is the local one plus
    3 rows, and the staged new/old values are the bits at the changed local positions."""
    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", SMALL_CHUNK)
    c = SMALL_CHUNK
    cols = 1000
    rows = -(-(3 * c + 17) // cols)  # the local tensor spans 3 chunks and a bit
    full_shape = (rows + 5, cols)
    snap = _base(rows * cols, seed=4).reshape(rows, cols)
    local_pick = _edges(c, snap.numel())
    cur = _with_changes(snap, local_pick)
    producer = Producer(snapshot="device")
    producer.seed([Shard.narrow("w", snap.clone(), full_shape, 0, 3)])
    cap = producer.scan([Shard.narrow("w", cur, full_shape, 0, 3)], kind="delta", anchor=False)
    (entry,) = cap.entries
    ref = _reference(cur, snap)
    assert ref.tolist() == local_pick and entry.changed == len(local_pick) == cap.changed
    assert torch.equal(entry.positions, ref + 3 * cols)
    assert torch.equal(entry.new_values.view(torch.int16), cur.reshape(-1).view(torch.int16)[ref])
    assert torch.equal(entry.old_values.view(torch.int16), snap.reshape(-1).view(torch.int16)[ref])
