"""`Entry.scanned`: the publisher lets the writer skip its two passes over every change (positions
sorted and unique, new bits != old bits) for `Producer.scan`'s own entries. That is safe only if
every scan path gives entries that pass those checks, which this test runs them through: the
bucket scan (fused kernel and torch path, strided qkv-like members whose runs are out of HF
order), buckets of one shard (a transposed tensor, tied views, a column slice mapped by `to_global`),
catch-ups and an anchor; and a caller's own positions are still
checked."""

from __future__ import annotations

import pytest
import torch
from test_bucket_scan import _buffer_segments, _own_bucket_shards, _perturb  # noqa: E402

from vllm_delta.sender import Shard, bucket_scan
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.publisher import _add
from vllm_delta.wire import FlushBuilder
from vllm_delta.wire.writer import UnchangedValueError


def _check_like_a_caller(entries, kind: str) -> int:
    """Every entry through `FlushBuilder.add` with every check on; the changes checked."""
    b = FlushBuilder(
        lambda name, f: None,
        version=1,
        base_version=0,
        encoding="ulp_zstd" if kind == "delta" else "planes_zstd",
    )
    n = 0
    for e in entries:
        assert e.scanned
        if e.positions.numel():
            b.add(
                e.name,
                e.positions,
                e.new_values,
                e.old_values if kind == "delta" else None,
                shape=e.full_shape,
            )
            n += e.positions.numel()
    return n


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_every_scan_path_gives_entries_that_pass_the_writers_checks(monkeypatch, path: str) -> None:
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "1" if path == "kernel" else "0")
    monkeypatch.setattr(bucket_scan, "MAX_RUNS", 8)  # the column slice's bucket maps by `to_global`
    buf, segs = _buffer_segments(6, gen=torch.Generator().manual_seed(1))
    other, own = _own_bucket_shards(torch.Generator().manual_seed(4))
    segs += own
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in segs])
    gen = torch.Generator().manual_seed(2)
    checked = 0
    for kind, anchor, ack in (
        ("delta", False, False),
        ("catchup", False, True),
        ("delta", True, True),
        ("delta", False, True),
    ):
        _perturb(buf, gen, 300, [0, buf.numel() - 1])
        _perturb(other, gen, 100, [0, other.numel() - 1])
        buf.view(torch.int16)[5:9] -= 1  # changed, then changed back below: bits equal again
        cap = producer.scan(segs, kind=kind, anchor=anchor)
        checked += _check_like_a_caller(cap.entries, kind)
        (producer.advance if ack else producer.defer)(cap)
        buf.view(torch.int16)[5:9] += 1
    assert checked > 1000


def test_plain_tensors_scanned_entries_pass_the_checks() -> None:
    gen = torch.Generator().manual_seed(3)
    ws = {f"w{i}": torch.randn(40, 30, generator=gen).to(torch.bfloat16) for i in range(3)}
    shards = [Shard.whole(k, v) for k, v in ws.items()]
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in shards])
    for s in shards:
        s.tensor.view(-1)[::37] += 1
    assert _check_like_a_caller(producer.scan(shards, kind="delta", anchor=False).entries, "delta") > 0


def test_a_callers_positions_and_values_are_still_checked() -> None:
    """Only entries made by the scan skip the checks: a caller's, through the publisher's `_add` too."""
    from vllm_delta.sender.capture import Entry

    b = FlushBuilder(lambda name, f: None, version=1, base_version=0, encoding="ulp_zstd")
    v = torch.ones(3, dtype=torch.bfloat16)
    unsorted = Entry("u", (8,), torch.bfloat16, 3, torch.tensor([1, 5, 3]), v + 1, v, {})
    with pytest.raises(ValueError, match="strictly increasing"):
        _add(b, unsorted, "delta")
    with pytest.raises(UnchangedValueError):
        _add(b, Entry("s", (8,), torch.bfloat16, 3, torch.tensor([1, 3, 5]), v, v, {}), "delta")
