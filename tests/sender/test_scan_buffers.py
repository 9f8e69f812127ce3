"""The fused CPU scan's output sets reused from one scan to the next (`kernels/scan.py` ScanBuffers):
never while anything still holds a view of them (a held capture, one entry's tensor), reused once
nothing does (counted in allocations, not timed), grown past 1/32 density and dropped when
oversized, at most two sets a window kept; every capture equal to the torch path's, scanned from
the same weights by a second producer."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from vllm_delta.kernels import scan as scan_kernel
from vllm_delta.kernels import switch
from vllm_delta.kernels.scan import ScanBuffers, alone
from vllm_delta.sender import Shard, bucket_scan
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.shards import Segments
from vllm_delta.wire import additive

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")
jit = pytest.importorskip("vllm_delta.kernels.scan_jit")


def _members(gen: torch.Generator, interleave: bool) -> tuple[torch.Tensor, list]:
    """One flat bf16 buffer, padded between members (gaps); with `interleave`, a [4, cols] param
    whose rows 0, 2 and 1, 3 are two members (runs out of (member, HF) order: the run array is used)."""
    sizes, pad = [5000, 3 * jit.CHUNK + 7, 999], 5
    buf = (torch.randn(sum(sizes) + pad * len(sizes), generator=gen) * 0.02).to(torch.bfloat16)
    shards, at = [], 0
    for i, n in enumerate(sizes):
        shards.append(Shard.whole(f"w{i}", buf[at : at + n]))
        at += n + pad
    if interleave:
        cols = sizes[0] // 4
        shards[0] = Segments(
            "q", buf.as_strided((2, cols), (2 * cols, 1), 0), (2, cols), ((cols, cols), (0, cols))
        )
        shards.insert(
            1, Segments("k", buf.as_strided((2, cols), (2 * cols, 1), cols), (2, cols), ((0, 2 * cols),))
        )
    return buf, shards


def _rows(cap) -> list[tuple]:
    return [
        (
            e.name,
            e.changed,
            e.positions.tolist(),
            e.new_values.view(torch.int16).tolist(),
            e.old_values.view(torch.int16).tolist(),
            {k: additive.to_hex(v) for k, v in e.digests.items()},
        )
        for e in cap.entries
    ]


class _Pair:
    """The kernel's producer and the torch path's, seeded alike, scanning the same live weights."""

    def __init__(self, interleave: bool, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.buf, self.shards = _members(self.gen, interleave)
        self.fast, self.ref = (
            Producer(snapshot="device", post_hash=False),
            Producer(snapshot="device", post_hash=False),
        )
        for p in (self.fast, self.ref):
            p.seed([s.with_tensor(s.tensor.clone()) for s in self.shards])

    def step(self, monkeypatch, density: float = 0.02):
        """Move a random `density` of the elements by one ULP; scan and advance both. The kernel's
        capture, and the torch path's rows."""
        bits = self.buf.view(torch.int16)
        idx = torch.randperm(self.buf.numel(), generator=self.gen)[: int(density * self.buf.numel())]
        bits[idx] += 1
        monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
        ref = self.ref.scan(self.shards, kind="delta", anchor=False)
        monkeypatch.delenv("VLLM_DELTA_KERNELS")
        cap = self.fast.scan(self.shards, kind="delta", anchor=False)
        self.ref.advance(ref)
        self.fast.advance(cap)
        return cap, _rows(ref)

    @property
    def buffers(self) -> ScanBuffers:
        (b,) = self.fast._buckets.values()
        return b.layout.buffers


@pytest.mark.parametrize("interleave", [False, True])
def test_a_held_view_is_never_written_over_and_a_dead_one_is_reused(monkeypatch, interleave: bool) -> None:
    pair = _Pair(interleave, 1)
    cap1, want1 = pair.step(monkeypatch)
    assert _rows(cap1) == want1 and pair.buffers.allocated == 1
    cap2, want2 = pair.step(monkeypatch)  # cap1 still held: a second set
    assert _rows(cap2) == want2 and _rows(cap1) == want1 and pair.buffers.allocated == 2
    del cap1
    cap3, want3 = pair.step(monkeypatch)  # cap1's set is free again
    assert _rows(cap3) == want3 and _rows(cap2) == want2 and pair.buffers.allocated == 2
    held = cap3.entries[-1].new_values[1:4]  # one entry's view of a view, its capture gone
    kept = held.view(torch.int16).tolist()
    del cap2, cap3
    cap4, want4 = pair.step(monkeypatch)  # cap2's set is free: reused
    assert _rows(cap4) == want4 and pair.buffers.allocated == 2
    del cap4
    cap5, want5 = pair.step(monkeypatch)  # cap4's set is free; cap3's is held by `held`: never both reused
    cap6, want6 = pair.step(monkeypatch)  # cap5 held: cap3's set still is, so a fresh one
    assert _rows(cap5) == want5 and _rows(cap6) == want6 and held.view(torch.int16).tolist() == kept
    assert pair.buffers.allocated == 3


@pytest.mark.parametrize("held", [0, 1, 3])
def test_allocations_and_sets_kept_by_what_the_caller_holds(monkeypatch, held: int) -> None:
    """Holding nothing: one set for every scan. The previous capture (the hook's `last_capture`): two.
    Three captures: a fresh set whenever every kept one is held, and never more than two kept."""
    pair, caps = _Pair(False, 2), []
    for _ in range(6):
        cap, want = pair.step(monkeypatch)
        assert _rows(cap) == want
        caps = (caps + [cap])[-held:] if held else []
        del cap
        assert all(len(sets) <= 2 for sets in pair.buffers._sets.values())
    assert pair.buffers.allocated == {0: 1, 1: 2, 3: 6}[held]


def _scan(layout: bucket_scan.Layout, snap: torch.Tensor, buffers: ScanBuffers, workers: int = 1) -> tuple:
    """The kernel into `buffers`, checked equal to the torch path; its changes."""
    n = len(layout.names)
    want = bucket_scan.torch_diff_digest(layout, layout.tables, snap, n)
    with ThreadPoolExecutor(workers) as pool:
        got = scan_kernel.diff_digest(
            layout.base, snap, layout.tables, n, False, workers, pool if workers > 1 else None, buffers
        )
    for name, g, w in zip(("pos", "old", "new", "hf"), got, want):
        assert torch.equal(
            g.view(torch.int16) if name in ("old", "new") else g,
            w.view(torch.int16) if name in ("old", "new") else w,
        ), name
    assert torch.equal(got[5], want[5]) and torch.equal(got[6], want[6])
    return got[0].numel()


def _flipped(buf: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    snap = buf.clone()
    snap.view(torch.int16)[torch.randperm(buf.numel(), generator=gen)[: int(density * buf.numel())]] ^= 1
    return snap


def test_a_denser_scan_grows_the_set_and_an_oversized_set_goes() -> None:
    gen = torch.Generator().manual_seed(3)
    buf = (torch.randn(10_000, generator=gen) * 0.02).to(torch.bfloat16)
    (layout,) = bucket_scan.plan([Shard.whole("w", buf)])
    buffers = ScanBuffers()
    sizes = lambda: sorted(s[0].size for sets in buffers._sets.values() for s in sets)  # noqa: E731
    assert jit.capacity(0, buf.numel()) == jit.CHUNK
    assert _scan(layout, _flipped(buf, 0.5, gen), buffers) == 5000  # past 2048: grown inside the kernel
    assert buffers.allocated == 1 and sizes() == [8192]  # the grown set is the one kept
    _scan(layout, _flipped(buf, 0.5, gen), buffers)
    assert buffers.allocated == 1 and sizes() == [8192]  # reused, not grown again
    assert _scan(layout, _flipped(buf, 0.001, gen), buffers) == 10
    assert buffers.allocated == 1 and sizes() == []  # 8192 > 2 x 10 changes: dropped
    _scan(layout, _flipped(buf, 0.001, gen), buffers)
    assert buffers.allocated == 2 and sizes() == [jit.CHUNK]


def test_thread_windows_each_reuse_their_set() -> None:
    """Each worker's window has its own set; concatenated outputs are copies, so all are free at once."""
    gen = torch.Generator().manual_seed(4)
    buf = (torch.randn(3 * 64 * jit.CHUNK, generator=gen) * 0.02).to(torch.bfloat16)
    (layout,) = bucket_scan.plan([Shard.whole("w", buf)])
    buffers = ScanBuffers()
    for _ in range(3):
        _scan(layout, _flipped(buf, 0.02, gen), buffers, workers=3)
    assert buffers.allocated == 3 and len(buffers._sets) == 3
    _scan(layout, _flipped(buf, 0.02, gen), buffers, workers=1)  # other windows: their sets go
    assert buffers.allocated == 4 and len(buffers._sets) == 1


def test_what_counts_as_held() -> None:
    """Every way a scan's output can still be read keeps its array's count up: a numpy view, a
    `torch.from_numpy` tensor, a torch view of that, `.numpy()` of one, a memoryview, a weak reference."""
    arrays = [np.empty(16, np.int64), np.empty(16, np.int16)]
    holders = {
        "numpy view": lambda: arrays[1][2:],
        "from_numpy": lambda: torch.from_numpy(arrays[0][:4]),
        "torch view": lambda: torch.from_numpy(arrays[0][:4])[1:].view(torch.int32),
        ".numpy()": lambda: torch.from_numpy(arrays[0]).reshape(4, 4).numpy(),
        "memoryview": lambda: memoryview(arrays[1]),
        "weakref": lambda: weakref.ref(arrays[0]),
    }
    assert alone(arrays)
    for name, make in holders.items():
        h = make()
        assert not alone(arrays), name
        del h
        assert alone(arrays), name
