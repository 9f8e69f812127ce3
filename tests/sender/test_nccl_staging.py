"""NCCL send buffers are bounded (issue 18 item 5): a flush moves in `NCCL_CHUNK_BYTES` broadcasts,
split the same way on both ends, through at most `NCCL_STAGING_SLOTS` buffer pairs at once.

The NCCL path itself needs CUDA; here the split (which both ends must agree on exactly) is checked
at its edges against sizes written out by hand, and the staging bound against real threads.
"""

from __future__ import annotations

import threading
import time

from vllm_delta.transports import groups
from vllm_delta.transports.groups import NCCL_CHUNK_BYTES, chunks

C = NCCL_CHUNK_BYTES


def test_a_flush_is_split_into_chunks_that_cover_it_exactly_at_the_edges():
    assert chunks(0) == []
    assert chunks(1) == [(0, 1)]
    assert chunks(C) == [(0, C)]
    assert chunks(C + 1) == [(0, C), (C, 1)]
    assert chunks(3 * C - 1) == [(0, C), (C, C), (2 * C, C - 1)]
    big = (1 << 33) + 5  # past 2^32 bytes: offsets stay exact Python ints
    got = chunks(big)
    assert len(got) == -(-big // C) and got[-1] == ((big // C) * C, 5)
    assert max(n for _, n in got) == C


def test_staging_slots_bound_the_buffers_held_at_once_over_every_engine():
    held, peak, lock = [0], [0], threading.Lock()

    def flush() -> None:
        with groups._staging:
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            time.sleep(0.02)
            with lock:
                held[0] -= 1

    threads = [threading.Thread(target=flush) for _ in range(8)]  # eight engines' groups at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == groups.NCCL_STAGING_SLOTS and held[0] == 0


def test_a_staging_buffer_is_one_chunk_at_most_whatever_the_flush():
    import torch

    g = groups.Group(
        spg=None, backend="nccl", timeout_s=1.0, bulk=type("Bulk", (), {"device": torch.device("meta")})
    )
    for size, want in [(5, 5), (C, C), (C + 1, C), (1 << 34, C)]:
        host, dev = g._staging_pair(size, pin=False)
        assert host is None and dev.numel() == want and dev.dtype == torch.uint8, size
