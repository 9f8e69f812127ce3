"""The encode side's zstd contexts: one per thread and level, reused for every frame.

Why a count: a flush holds one zstd frame per stream per block (a 10 M-change sync: ~2,000 frames),
and making a context costs ~17 us each, about a fifth of a sync's encode on one CPU thread; and a
reused context must write the same bytes as a fresh one (the format is pinned by test_golden.py).
"""

from __future__ import annotations

import threading

import torch
import zstandard

from vllm_delta.wire import FlushBuilder, container
from vllm_delta.wire.blocks import Policy

SMALL_BLOCKS = Policy(span_bits=6, min_entries=8, max_entries=64)  # several blocks per param


class _Counting:
    """Counts the compression contexts made. A wrapper, not a subclass (see test_batch._Counting)."""

    made = 0

    def __init__(self, *args, **kwargs):
        self._real = _REAL_COMPRESSOR(*args, **kwargs)
        type(self).made += 1

    def __getattr__(self, name):
        return getattr(self._real, name)


_REAL_COMPRESSOR = zstandard.ZstdCompressor


def _changes(params: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(params)
    out = []
    for i in range(params):
        pos = torch.randperm(4096, generator=g)[:300].sort().values
        old = torch.randn(300, generator=g).bfloat16()
        new = (old.view(torch.int16) + torch.randint(1, 4, (300,), generator=g, dtype=torch.int16)).view(
            torch.bfloat16
        )
        out.append((f"p{i}", pos, new, old))
    return out


def _encode(params: int) -> tuple[list[bytes], int]:
    """The flushes of `params` params' changes, and the contexts made encoding them (on a fresh thread
    state, so this thread's cached contexts don't hide any)."""

    class Counting(_Counting):
        made = 0

    flushes: list[bytes] = []
    real = zstandard.ZstdCompressor, container._local
    zstandard.ZstdCompressor, container._local = Counting, threading.local()
    try:
        b = FlushBuilder(
            lambda name, f: flushes.append(f.data),
            version=1,
            base_version=0,
            encoding="ulp_zstd",
            flush_bytes=1 << 30,
            block_policy=SMALL_BLOCKS,
        )
        for name, pos, new, old in _changes(params):
            b.add(name, pos, new, old, shape=(4096,))
        b.manifest()
    finally:
        zstandard.ZstdCompressor, container._local = real
    return flushes, Counting.made


def test_compression_contexts_per_flush_do_not_grow_with_frames():
    small, made_small = _encode(4)
    big, made_big = _encode(64)
    assert len(small) == len(big) == 1
    assert made_small == made_big == 1  # 16x the params and frames, one context


def test_a_reused_context_writes_the_bytes_of_a_fresh_one():
    """Independent of `container.compress`: every frame recompressed by a fresh context, byte for byte."""
    frames = [bytes(range(256)) * 7, b"\0" * 5000, bytes(100), b"x"]
    for level in (1, 3, 1):
        for data in frames:
            assert container.compress(data, level) == zstandard.ZstdCompressor(level=level).compress(data)


def test_each_thread_gets_its_own_context():
    seen = []
    t = threading.Thread(target=lambda: seen.append(container.compressor(1)))
    t.start()
    t.join()
    assert seen[0] is not container.compressor(1) and container.compressor(1) is container.compressor(1)
