"""Anchors that stream (issue 18, "Why 2"): a capture for an anchor stages nothing per element, and the
anchor read piece by piece from the snapshot plus the capture's changes is the captured weights, bit
for bit, even after the live weights moved on."""

from __future__ import annotations

import json

import pytest
import torch
from harness.capture_bytes import staged_bytes

from vllm_delta.sender import Shard
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.shards import Segments
from vllm_delta.wire import DeltaDecoder, FlushBuilder

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def placements(dtype: torch.dtype):
    """(shard, the full tensor it is part of) for each layout an anchor walks: whole, a column slice,
    interleaved row pieces, and flat runs given out of HF order."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(24, 40, generator=g).to(dtype)
    flat = full.reshape(-1)
    runs = ((500, 37), (3, 200), (900, 60))
    seg = torch.cat([flat[a : a + n] for a, n in runs])
    return [
        (Shard.whole("whole", full.clone()), full),
        (Shard.narrow("cols", full[:, 8:21].contiguous(), full.shape, 1, 8), full),
        (
            Shard.pieces(
                "rows", torch.cat([full[12:16], full[2:5]]).contiguous(), full.shape, 0, [(12, 4), (2, 3)]
            ),
            full,
        ),
        (Segments("runs", seg.clone(), full.shape, runs), full),
    ]


def edit(t: torch.Tensor, seed: int) -> None:
    """Move some elements, including changes floats call equal (+0 to -0) and NaN payloads."""
    bits = t.view(-1).view(_BITS[t.dtype])
    g = torch.Generator().manual_seed(seed)
    bits[torch.randint(0, bits.numel(), (max(1, bits.numel() // 20),), generator=g)] += 1
    t.view(-1)[0] = 0.0
    bits[-1] = {torch.int16: 0x7FC1, torch.int32: 0x7FC00001}[bits.dtype]
    t.view(-1)[1] = -0.0


def decode_anchor(entries, flush_bytes: int):
    """The entries' anchors through the publisher's call (`add_dense` of `pieces(flush_bytes)`), decoded."""
    out = []
    b = FlushBuilder(
        lambda name, f: out.append((name, f.data)), version=3, encoding="planes_zstd", flush_bytes=flush_bytes
    )
    for e in entries:
        b.add_dense(e.name, e.anchor.pieces(b.flush_bytes), shape=e.full_shape)
    dec = DeltaDecoder(b.manifest())
    deltas = [pd for name, data in out for pd in dec.feed(name, data)]
    dec.finish()
    return deltas, len(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["delta", "catchup", ""])
def test_streamed_anchor_is_the_captured_weights_bit_for_bit(dtype, kind):
    shards = placements(dtype)
    producer = Producer(snapshot="device")
    producer.seed([s for s, _ in shards])
    if kind == "catchup":  # positions sent since S while an engine lagged
        for s, _ in shards:
            edit(s.tensor, 7)
        producer.defer(producer.scan([s for s, _ in shards], kind="delta", anchor=False))
    for s, _ in shards:
        edit(s.tensor, 8)
    cap = producer.scan([s for s, _ in shards], kind=kind, anchor=True)
    captured = {s.name: s.tensor.clone() for s, _ in shards}
    for s, _ in shards:  # training goes on while the anchor is encoded
        edit(s.tensor, 9)
    deltas, flushes = decode_anchor(cap.entries, flush_bytes=300)
    assert flushes > 10  # small flushes: pieces and params cut across many
    for s, full in shards:
        want = torch.zeros(full.numel(), dtype=dtype)
        want[s.to_global(torch.arange(s.tensor.numel()))] = captured[s.name].reshape(-1)
        got = torch.zeros(full.numel(), dtype=dtype)
        mine = [pd for pd in deltas if pd.name == s.name]
        for pd in mine:
            got[pd.positions] = pd.values
        bits = _BITS[dtype]
        assert torch.equal(got.view(bits), want.view(bits)), s.name
        assert sum(pd.count for pd in mine) == s.tensor.numel(), s.name
        positions = torch.cat([pd.positions for pd in mine])
        assert bool((positions[1:] > positions[:-1]).all()), s.name  # HF order, each element once


@pytest.mark.parametrize("layout", ["whole", "cols"])
def test_an_anchor_capture_stages_nothing_per_element(layout):
    """The bytes a capture holds are O(changed) with an anchor as without one. Before: an int64
    position and a copy of the value per element (10 B per bf16 element, 20 MiB here)."""
    full = torch.randn(512, 4096).to(torch.bfloat16)  # 2 M elements
    s = (
        Shard.whole("w", full)
        if layout == "whole"
        else Shard.narrow("w", full[:, 1024:].contiguous(), full.shape, 1, 1024)
    )
    producer = Producer(snapshot="device")
    producer.seed([s])
    s.tensor.view(-1).view(torch.int16)[::4096] += 1  # ~1000 changes
    changed = s.tensor.numel() // 4096
    for kind in ("delta", ""):
        without = producer.scan([s], kind=kind, anchor=False)
        cap = producer.scan([s], kind=kind, anchor=True)
        assert cap.changed == without.changed == changed
        held = staged_bytes(cap, producer, [s.tensor])
        assert held <= 32 * changed + 4096, (kind, held)
        assert held <= staged_bytes(without, producer, [s.tensor]) + 64  # the anchor adds nothing per element


def test_anchor_pieces_are_bounded_by_the_flush_whatever_the_shard():
    """Each piece an anchor reads is at most the flush's bytes, whatever the tensor's size."""
    full = torch.zeros(3000, 7, dtype=torch.float32)
    s = Shard.narrow("w", full[:, 2:].contiguous(), full.shape, 1, 2)
    producer = Producer(snapshot="device")
    producer.seed([s])
    (e,) = producer.scan([s], kind="", anchor=True).entries
    sizes = [p.numel() * p.element_size() for _, p in e.anchor.pieces(64)]
    assert max(sizes) <= 64 and sum(sizes) == s.tensor.numel() * 4


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


@pytest.mark.heavy
def test_anchor_of_a_tensor_past_2_31_elements_streams_in_about_a_flush():
    """2^31 + 2^20 + 3 int8 elements (a stride-0 snapshot: no memory of its own) with changes either
    side of 2^31 and at the last element: the flushes cover every element once, in order, each at
    most a flush of values; those holding the first element, 2^31 - 1, 2^31 and the last decode whole to the
    captured values (the snapshot's 7 except the changes), the others by the blocks holding changes
    (decoding 2^31 int64 positions would dominate the test); the peak RSS grows by a few flushes,
    decoding included, not by the tensor (2 GiB; before: 9 B per element staged)."""
    from vllm_delta.sender.capture import Anchor
    from vllm_delta.wire import Limits
    from vllm_delta.wire.container import unpack
    from vllm_delta.wire.flush import iter_flush, open_flush

    n, flush = (1 << 31) + (1 << 20) + 3, 8 << 20
    snapshot = torch.full((1,), 7, dtype=torch.int8).expand(n)
    pos = torch.tensor([0, 5, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, n - 1])
    vals = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int8)
    anchor = Anchor(("w", (n,), 0, ((0, n),)), snapshot, pos, vals, torch.device("cpu"))
    seen, counts, ends, later = [], [], [], []
    full = [0, (1 << 31) - 1, 1 << 31, n - 1]  # flushes holding these decode whole (2^31 starts one)

    def check(name: str, data: bytes, *, whole: bool) -> None:
        tensors, meta, budget = open_flush(data, file=name, limits=Limits())
        owned = None if whole else {"w": [(int(q), int(q)) for q in pos]}  # else the blocks with changes
        for pd in iter_flush(tensors, meta, budget, file=name, owned=owned)[1]:
            if whole:
                assert pd.positions[-1] - pd.positions[0] + 1 == pd.count == pd.total
            moved = pd.values != 7
            seen.extend(zip(pd.positions[moved].tolist(), pd.values[moved].tolist()))
            counts.append(pd.total)
            ends.append(pd.bounds)

    def emit(name, f) -> None:  # the rest is checked as it is emitted, then dropped
        (p,) = json.loads(unpack(f.data, file=name, limits=Limits())[1]["params"])
        if any(p["blocks"][0][0] <= q <= p["blocks"][-1][1] for q in full):
            later.append((name, f.data))  # decoded whole after the memory is measured
        else:
            check(name, f.data, whole=False)

    b = FlushBuilder(emit, version=1, encoding="deltas", flush_bytes=flush)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    base = _rss("VmRSS")
    b.add_dense("w", anchor.pieces(b.flush_bytes), shape=(n,))
    manifest = b.manifest()
    extra = _rss("VmHWM") - base
    assert len(later) == 3  # 2^31 starts the last flush, which also holds n - 1
    for name, data in later:
        check(name, data, whole=True)
    order = sorted(range(len(ends)), key=lambda i: ends[i])
    seen = sorted(seen)
    counts, ends = [counts[i] for i in order], [ends[i] for i in order]
    assert seen == list(zip(pos.tolist(), vals.tolist()))
    assert sum(counts) == n == manifest.params[0].changed and max(counts) <= flush
    assert ends[0][0] == 0 and ends[-1][1] == n - 1 and all(a[1] + 1 == b[0] for a, b in zip(ends, ends[1:]))
    assert extra < 16 * flush, f"{extra / 2**20:.0f} MiB over the RSS before the anchor (3 flushes kept)"
