"""The fused CPU scan (`kernels/scan.py`, numba) against the torch path it replaces
(`bucket_scan.torch_diff_digest`): every output equal on buckets with gaps, interleaved runs, odd
lengths, the kernel's chunk edges and thread-window edges, densities from 0 to 100%, and NaN /
inf / -0.0 bit patterns; its digests equal to `wire.additive`'s and to a pure-Python splitmix /
fmix sum written here; and the dispatch (kernel on CPU when numba is there, torch otherwise)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from vllm_delta.kernels import scan as scan_kernel
from vllm_delta.kernels import switch
from vllm_delta.sender import Shard, bucket_scan
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.shards import Segments
from vllm_delta.wire import additive

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")
jit = pytest.importorskip("vllm_delta.kernels.scan_jit")
CHUNK = jit.CHUNK
M64 = (1 << 64) - 1


def _bucket(
    dtype: torch.dtype, sizes: list[int], gaps: list[int], gen: torch.Generator, interleave: bool = False
) -> tuple[torch.Tensor, list[Segments]]:
    """A flat buffer of members of `sizes` elements with `gaps[i]` uncovered elements before
    member i; with `interleave`, member 0 is two row-halves of a [4, cols] param whose local runs
    land in reverse HF order (so the bucket is not in (member, HF) order)."""
    buf = (torch.randn(sum(sizes) + sum(gaps), generator=gen) * 0.02).to(dtype)
    segs, at = [], 0
    for i, (n, g) in enumerate(zip(sizes, gaps)):
        at += g
        view = buf[at : at + n]
        if interleave and i == 0:
            cols = n // 4
            rows = buf.as_strided((2, cols), (2 * cols, 1), at)  # rows 0 and 2
            segs.append(Segments("m0.q", rows, (2, cols), ((cols, cols), (0, cols))))
            segs.append(
                Segments(
                    "m0.k", buf.as_strided((2, cols), (2 * cols, 1), at + cols), (2, cols), ((0, 2 * cols),)
                )
            )
        else:
            segs.append(Segments(f"m{i}", view, (n + 5,), ((5, n),)))  # HF positions shifted by 5
        at += n
    return buf, segs


def _layout(segs: list[Segments]) -> bucket_scan.Layout:
    (layout,) = bucket_scan.plan(segs)
    return layout


def _both(layout: bucket_scan.Layout, snap: torch.Tensor, workers: int = 1):
    n = len(layout.names)
    want = bucket_scan.torch_diff_digest(layout, layout.tables, snap, n)
    with ThreadPoolExecutor(workers) as pool:
        got = scan_kernel.diff_digest(
            layout.base, snap, layout.tables, n, True, workers, pool if workers > 1 else None
        )
    return got, want


def _assert_equal(got, want) -> None:
    names = ("pos", "old", "new", "hf", "run", "pre", "post")
    for name, g, w in zip(names, got, want):
        if name == "run" and w is None:  # one run: the torch path needs no run index
            continue
        if name in ("old", "new"):
            g, w = (
                g.view(torch.int16 if g.element_size() == 2 else torch.int32),
                w.view(torch.int16 if w.element_size() == 2 else torch.int32),
            )
        assert g.dtype == w.dtype and torch.equal(g, w), name


def _perturb(buf: torch.Tensor, gen: torch.Generator, density: float, extra: list[int]) -> torch.Tensor:
    """Flip the low bit of a random `density` of the elements and of `extra`; return the snapshot."""
    snap = buf.clone()
    bits = buf.view(torch.int16 if buf.element_size() == 2 else torch.int32)
    k = int(buf.numel() * density)
    idx = torch.cat([torch.randperm(buf.numel(), generator=gen)[:k], torch.tensor(extra, dtype=torch.int64)])
    bits[idx] ^= 1
    return snap


@pytest.mark.parametrize("density", [0.0, 1e-5, 0.02, 1.0])
@pytest.mark.parametrize("interleave", [False, True])
def test_kernel_equals_the_torch_path(density: float, interleave: bool) -> None:
    gen = torch.Generator().manual_seed(int(density * 1e5) + interleave)
    # odd sizes and gaps: runs start and end off the scratch's words and chunks
    buf, segs = _bucket(
        torch.bfloat16, [4 * 1001, 3 * CHUNK + 3, 7, CHUNK, 5 * CHUNK - 1], [0, 3, 1, 2, 9], gen, interleave
    )
    layout = _layout(segs)
    assert layout.gaps and layout.in_order is not interleave
    ends = [r[0] + r[2] for r in layout.rows]
    edges = sorted(
        {p for r in layout.rows for p in (r[0], r[0] + r[2] - 1)}
        | {CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, buf.numel() - 1}
        | {e for e in ends if e < buf.numel()}
    )  # the first element of every gap
    snap = _perturb(buf, gen, density, edges if density else [])
    got, want = _both(layout, snap)
    _assert_equal(got, want)
    if density:
        assert got[0][-1] == buf.numel() - 1  # the last member ends at the span's end
    if density == 1.0:
        assert got[0].numel() == sum(r[2] for r in layout.rows)  # past the first capacity: grown


def test_thread_windows_cut_anywhere() -> None:
    """The span cut into windows (one per worker), window edges inside runs and gaps."""
    gen = torch.Generator().manual_seed(7)
    buf, segs = _bucket(torch.bfloat16, [200_001, 3, 140_000, 99_999], [0, 11, 1, 5], gen, interleave=True)
    layout = _layout(segs)
    windows = scan_kernel._windows(buf.numel(), 3, CHUNK)
    assert len(windows) == 3
    edges = [p + d for a, _ in windows[1:] for p in [a] for d in (-1, 0, 1)]
    snap = _perturb(buf, gen, 0.02, edges)
    got, want = _both(layout, snap, workers=3)
    _assert_equal(got, want)
    assert all(
        bool((got[0] == e).any()) or not any(r[0] <= e < r[0] + r[2] for r in layout.rows) for e in edges
    )


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_both_ways_of_finding_changes(dtype) -> None:
    """`find_compress` (AVX-512 compress stores, where the CPU has them) and `find_words` (CPUs without
    them; the kernel takes one by the CPU it is compiled for) find exactly numpy's changed indices, at
    every length of a chunk's tail and at densities up to every element."""
    rng = np.random.default_rng(3)
    at = np.empty(CHUNK, np.int32)
    d = np.zeros(CHUNK, dtype)
    for m in (0, 1, 3, 15, 16, 17, 31, 100, CHUNK - 5, CHUNK):
        for density in (0.0, 0.02, 0.5, 1.0):
            x = rng.integers(0, np.iinfo(dtype).max, m, dtype=dtype)
            y = x.copy()
            flip = rng.random(m) < density
            y[flip] ^= dtype(
                1 << (8 * np.dtype(dtype).itemsize - 1)
            )  # the top bit: a sign-extension bug shows
            want = np.flatnonzero(x != y)
            d[:] = 7  # a stale scratch from the chunk before
            got = jit.find_words(x, y, at, d, d.view(np.uint64))
            assert np.array_equal(at[:got], want), ("words", m, density)
            if jit.COMPRESS:  # AVX-512 only, as the kernel takes it
                got = jit.find_compress(x, y, at)
                assert np.array_equal(at[:got], want), ("compress", m, density)


def _py_lanes(hf: list[int], bits: list[int], width: int) -> tuple[int, int]:
    """splitmix64 / Murmur3 fmix64 of key = hf << width | bits, summed mod 2^64, in Python ints."""

    def mix(x: int, shifts: tuple[int, int, int], mults: tuple[int, int]) -> int:
        x ^= x >> shifts[0]
        x = (x * mults[0]) & M64
        x ^= x >> shifts[1]
        x = (x * mults[1]) & M64
        return x ^ (x >> shifts[2])

    a = b = 0
    for h, v in zip(hf, bits):
        key = (h << width) | v
        a = (a + mix(key, (30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))) & M64
        b = (b + mix(key ^ 0xC2B2AE3D27D4EB4F, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))) & M64
    return a, b


NAN, NAN2, INF, NINF, ZERO, NZERO, ALL = 0x7FC0, 0x7FC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0xFFFF


def test_special_bit_patterns_and_digests_against_python() -> None:
    """NaN payloads, inf, -0.0 vs +0.0 and 0xFFFF (a sign-extension bug shows there) are changes;
    equal NaNs are not; the digests are the pure-Python lane sums and `additive.partial_sum`'s."""
    pairs = [
        (NAN, NAN2),
        (NAN, NAN),
        (INF, NINF),
        (ZERO, NZERO),
        (NZERO, ZERO),
        (ALL, ZERO),
        (ZERO, ALL),
        (INF, INF),
        (0x3F80, ALL),
    ]
    old = torch.tensor([o for o, _ in pairs] * 3, dtype=torch.int32).to(torch.int16)
    new = torch.tensor([n for _, n in pairs] * 3, dtype=torch.int32).to(torch.int16)
    buf = new.view(torch.bfloat16).clone()
    segs = [Segments("a", buf[:9], (100,), ((90, 9),)), Segments("b", buf[12:], (15,), ((0, 15),))]
    layout = _layout(segs)
    snap = old.view(torch.bfloat16)[:27].clone()
    got, want = _both(layout, snap)
    _assert_equal(got, want)
    changed = [i for i, (o, n) in enumerate(pairs * 3) if o != n and (i < 9 or i >= 12)]
    assert got[0].tolist() == changed
    for k, (rows, shift) in enumerate(((range(0, 9), 90), (range(12, 27), -12))):
        mine = [i for i in changed if i in rows]
        hf = [i + shift for i in mine]
        for col, bits in ((0, [pairs[i % 9][0] for i in mine]), (1, [pairs[i % 9][1] for i in mine])):
            py = _py_lanes(hf, bits, 16)
            sums = got[5 + col][k]
            assert tuple(int(x) & M64 for x in sums.tolist()) == py
            vals = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            assert torch.equal(sums, additive.partial_sum(torch.tensor(hf, dtype=torch.int64), vals))


def test_float32_buckets() -> None:
    """32-bit elements: key = position << 32 | bits; digests as `additive` computes them."""
    gen = torch.Generator().manual_seed(9)
    buf, segs = _bucket(torch.float32, [CHUNK + 1, 333], [0, 2], gen)
    layout = _layout(segs)
    snap = _perturb(buf, gen, 0.05, [CHUNK - 1, CHUNK, buf.numel() - 1])
    snap.view(torch.int32)[5] = -1  # 0xFFFFFFFF: a sign-extension bug shows in the digest
    got, want = _both(layout, snap)
    _assert_equal(got, want)
    pos = got[0][got[0] < CHUNK + 1]
    assert torch.equal(got[5][0], additive.partial_sum(pos + 5, snap[pos]))


def _scan_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = scan_kernel.diff_digest

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(scan_kernel, "diff_digest", counted)
    return calls


def _captures(segs: list, buf: torch.Tensor, seed: int) -> list[list[tuple]]:
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in segs])
    gen, out = torch.Generator().manual_seed(seed), []
    for kind, ack in (("delta", False), ("catchup", True), ("delta", True)):
        _perturb(buf, gen, 0.03, [0, buf.numel() - 1])
        cap = producer.scan(segs, kind=kind, anchor=False)
        out.append(
            [
                (
                    e.name,
                    e.changed,
                    e.positions.tolist(),
                    e.new_values.view(torch.int16).tolist(),
                    None if e.old_values is None else e.old_values.view(torch.int16).tolist(),
                    {k: additive.to_hex(v) for k, v in e.digests.items()},
                )
                for e in cap.entries
            ]
        )
        (producer.advance if ack else producer.defer)(cap)
    return out


def test_producer_dispatch_kernel_on_cpu_torch_when_forced(monkeypatch) -> None:
    """`Producer.scan` takes the kernel on CPU weights; `VLLM_DELTA_KERNELS=0` (or no numba)
    takes the torch path; the entries (positions, values, digests) are the same either way."""
    gen = torch.Generator().manual_seed(11)
    buf, segs = _bucket(torch.bfloat16, [400, 3 * 77, 64], [0, 3, 1], gen, interleave=True)
    start = buf.clone()
    calls = _scan_calls(monkeypatch)
    fast = _captures(segs, buf, 12)
    assert len(calls) == 3
    buf.copy_(start)
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert _captures(segs, buf, 12) == fast and len(calls) == 3
    monkeypatch.delenv("VLLM_DELTA_KERNELS")
    monkeypatch.setattr(switch, "HAVE_NUMBA", False)
    buf.copy_(start)
    assert _captures(segs, buf, 12) == fast and len(calls) == 3


def test_what_the_kernel_takes() -> None:
    """CPU, contiguous, 16- and 32-bit elements; anything else (64-bit keys mix differently, meta,
    a 1-byte dtype it is not tested on) goes the torch way."""
    x = torch.zeros(8, dtype=torch.bfloat16)
    assert scan_kernel.applies(x, x.clone()) and scan_kernel.applies(x.float(), x.float())
    assert not scan_kernel.applies(x.double(), x.double())
    assert not scan_kernel.applies(x.to(torch.uint8), x.to(torch.uint8))
    m = torch.empty(8, dtype=torch.bfloat16, device="meta")
    assert not scan_kernel.applies(m, m) and not scan_kernel.applies(x, m)
    assert not scan_kernel.applies(x[::2], x[::2].clone())
    plain = Shard.whole("w", torch.zeros(3, 5, dtype=torch.bfloat16))
    assert bucket_scan.plan([plain])[0].base.is_contiguous()
