"""Bytes a capture holds, walked through its dataclasses: what an anchor stages per element.

Why here: the anchor test (tests/sender/test_anchor.py) asserts it, and the anchor benchmark
(benchmarks/anchor_memory.py) reports it; both must count the same way.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_delta.sender.capture import Bucket, Capture
from vllm_delta.sender.producer import Producer


def staged_bytes(cap: Capture, producer: Producer, live: list[torch.Tensor]) -> int:
    """Bytes of every storage the capture holds, anywhere in it, except the snapshots' (its buckets') and
    the live weights' (what an anchor may read without staging)."""
    skip = {
        t.untyped_storage().data_ptr() for t in [*(producer.snapshot_of(n) for n in producer.names), *live]
    }
    seen: dict[int, int] = {}

    def visit(x) -> None:
        if isinstance(x, Bucket):  # the snapshot and run tables every capture shares: nothing staged
            return
        if isinstance(x, torch.Tensor):
            if x.untyped_storage().data_ptr() not in skip:
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(cap)
    return sum(seen.values())
