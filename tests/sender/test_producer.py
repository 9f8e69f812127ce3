"""The producer without engines: shard placement against torch's own slicing, disjointness, the scan
on the `meta` device (a CPU tensor meeting a device tensor raises there, as it would on CUDA), the
device diff on CPU tensors against plain torch and the host diff, and capture/publish ordering
against fake engines."""

from __future__ import annotations

import pytest
import torch

from vllm_delta import DeltaSender
from vllm_delta.sender import Shard
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.shards import check_disjoint
from vllm_delta.wire import additive

FULL = torch.arange(12 * 10 * 3, dtype=torch.int64).reshape(12, 10, 3)


def _check_against_slicing(shard: Shard, local: torch.Tensor) -> None:
    """Every local element's global position holds the same value in the full tensor (torch slicing
    made the local tensor; the placement must invert it)."""
    pos = torch.arange(local.numel())
    assert torch.equal(FULL.reshape(-1)[shard.to_global(pos)], local.reshape(-1))


@pytest.mark.parametrize(
    "dim,spans",
    [
        (0, [(4, 3)]),  # TP row slice
        (1, [(2, 5)]),  # TP column slice
        (2, [(1, 2)]),  # innermost dim
        (0, [(0, 2), (6, 2), (3, 1)]),  # interleaved query groups, out of order
        (1, [(8, 2), (0, 3)]),  # column pieces: every row interleaves them
    ],
)
def test_to_global_inverts_torch_slicing(dim: int, spans: list[tuple[int, int]]) -> None:
    local = torch.cat([FULL.narrow(dim, a, n) for a, n in spans], dim=dim)
    shard = Shard.pieces("w", local, FULL.shape, dim, spans)
    _check_against_slicing(shard, local)
    g = shard.global_index()
    assert g.unique().numel() == local.numel()


def test_whole_and_bad_shapes() -> None:
    assert torch.equal(Shard.whole("w", FULL).global_index(), torch.arange(FULL.numel()))
    with pytest.raises(ValueError, match="local shape"):
        Shard.narrow("w", FULL[:3], FULL.shape, 1, 0)
    with pytest.raises(ValueError, match="overlap or leave"):
        Shard.pieces("w", torch.cat([FULL[0:2], FULL[1:3]]), FULL.shape, 0, [(0, 2), (1, 2)])


def test_check_disjoint_reports_overlap_and_coverage() -> None:
    a = Shard.narrow("w", FULL[:6], FULL.shape, 0, 0).describe()
    b = Shard.narrow("w", FULL[6:], FULL.shape, 0, 6).describe()
    c = Shard.narrow("w", FULL[5:7], FULL.shape, 0, 5).describe()
    assert check_disjoint([a, b]) == {"w": 1.0}
    assert check_disjoint([a]) == {"w": 0.5}
    with pytest.raises(ValueError, match="both hold dim 0 indices 5..5"):
        check_disjoint([a, c])
    with pytest.raises(ValueError, match="different dims"):
        check_disjoint([a, Shard.narrow("w", FULL[:, :5], FULL.shape, 1, 0).describe()])


def test_partial_digests_of_shards_add_up_to_the_whole() -> None:
    w = torch.randn(8, 6).to(torch.bfloat16)
    left = Shard.narrow("w", w[:, :4].contiguous(), w.shape, 1, 0)
    right = Shard.narrow("w", w[:, 4:].contiguous(), w.shape, 1, 4)
    parts = [
        additive.to_hex(additive.partial_sum(s.global_index(), s.tensor.reshape(-1))) for s in (left, right)
    ]
    assert additive.combine(*parts) == additive.to_hex(additive.tensor_sum(w))


def test_scan_runs_on_meta_device(meta_nonzero) -> None:
    """Every op of the scan (diff, gather, shard map, digests, sort, pending union, snapshot advance)
    on meta tensors: any tensor made on the CPU (arange, index tables, `.cpu()`) raises here."""
    w = torch.empty(8, 12, dtype=torch.bfloat16, device="meta")
    shards = [
        Shard.whole("a", w),
        Shard.pieces(
            "b", torch.empty(4, 12, dtype=torch.bfloat16, device="meta"), (8, 12), 0, [(0, 2), (4, 2)]
        ),
    ]
    producer = Producer(snapshot="device", staging="meta")
    producer.seed(shards)
    for kind, anchor in (("delta", False), ("catchup", True), ("", True)):
        cap = producer.scan(shards, kind=kind, anchor=anchor)
        for e in cap.entries:
            tensors = [e.positions, e.new_values, *e.digests.values()]
            tensors += [e.anchor.snapshot, e.anchor.positions, e.anchor.values] if anchor else []
            assert all(t.device.type == "meta" for t in tensors), e.name
            assert e.post_hash is None  # xxh3 would pull the tensor to the host
        producer.defer(cap)
    producer.advance(cap)
    assert producer.snapshot_of("a").device.type == "meta"


_INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
_QUIET_NAN = {torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_diff_matches_the_host_diff_element_for_element(monkeypatch, dtype) -> None:
    """The diff every accelerator (and meta) runs, `device_positions`, on CPU tensors: the same
    positions as plain torch's bit compare and as the host path (numpy, chunked, the chunk shrunk so
    that the tensor spans many), including changes that compare equal as floats (+0.0 to -0.0, one
    NaN payload to another) and equal bits that are not changes (the same NaN on both sides)."""
    import vllm_delta.diff as diff

    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", 1000)
    ints = _INT[dtype]
    gen = torch.Generator().manual_seed(5)
    snap = torch.randn(20_011, generator=gen).to(dtype)
    cur = snap.clone()
    cur_bits, snap_bits = cur.view(ints), snap.view(ints)
    moved = torch.randint(0, snap.numel(), (400,), generator=gen)
    cur_bits[moved] += 1
    cur_bits[[0, 999, 1000, 19_999, 20_010]] ^= 1  # chunk edges
    snap[7], cur[7] = 0.0, -0.0
    nan = _QUIET_NAN[dtype]
    snap_bits[8], cur_bits[8] = nan, nan | 1  # two quiet NaNs, different payloads
    snap_bits[9] = cur_bits[9] = nan | 2  # the same NaN: no change
    want = torch.nonzero(cur_bits != snap_bits).reshape(-1)
    assert 8 in want and 9 not in want and 7 in want
    got_device = diff.device_positions(diff.int_view(cur), diff.int_view(snap))
    got_host = diff.changed_positions(cur, snap)
    assert torch.equal(got_device, want)
    assert torch.equal(got_host, want)
    assert got_device.dtype == got_host.dtype == torch.int64
    assert diff.device_positions(diff.int_view(snap), diff.int_view(snap)).numel() == 0


def test_capture_then_publish_overlaps_and_advances_only_after_ack(
    fake_engines, fake_weights, tmp_path
) -> None:
    sender = DeltaSender([e.url for e in fake_engines], "disk", tmp_path, retries=0)
    sender.seed(fake_weights)
    weights = {k: v.clone() for k, v in fake_weights.items()}
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        for t in weights.values():
            t.view(-1)[torch.randint(0, t.numel(), (50,), generator=gen)] += 0.01
        sender.capture(weights)
        expected = {k: v.clone() for k, v in weights.items()}
        future = sender.publish()
        for t in weights.values():  # the next step mutates the weights while the publish runs
            t.add_(1.0)
        metrics = future.result()
        for t in weights.values():
            t.sub_(1.0)
        assert metrics["sender/all_acked"] == 1.0 and metrics["sender/version"] == step
        # The snapshot's bytes move at the next capture/wait, on the main thread, never under a scan.
        assert not torch.equal(
            sender.producer.snapshot_of("layer0.weight"), expected["layer0.weight"].view(-1)
        )
        sender.wait()
        assert sender.snapshot_version == step
        assert torch.equal(sender.producer.snapshot_of("layer0.weight"), expected["layer0.weight"].view(-1))
        for e in fake_engines:
            assert all(torch.equal(e.weights[k], expected[k]) for k in expected), (step, e.url)
    with pytest.raises(RuntimeError, match="capture"):
        sender.publish()
    sender.close()


def test_tied_weight_is_sent_once_under_the_checkpoint_name(fake_engines, fake_weights, tmp_path) -> None:
    sender = DeltaSender([e.url for e in fake_engines], "disk", tmp_path, retries=0)
    sender.seed(fake_weights)
    weights = {k: v.clone() for k, v in fake_weights.items()}
    tied = dict(weights, **{"lm_head.weight": weights["layer0.weight"]})  # same storage, another name
    weights["layer0.weight"].view(-1)[:10] += 1
    m = sender.sync(tied)
    assert m["sender/all_acked"] == 1.0 and m["sender/changed_elements"] == 10
    with pytest.raises(KeyError, match="lm_head"):
        sender.sync(dict(weights, **{"lm_head.weight": weights["layer0.weight"].clone()}))


@pytest.mark.parametrize("kind", ["shard", "segments"])
def test_seed_from_checkpoint_takes_this_ranks_elements(kind, tmp_path) -> None:
    from safetensors.torch import save_file

    from vllm_delta.sender.shards import Segments

    full = torch.randn(6, 4).to(torch.bfloat16)
    save_file({"w": full}, tmp_path / "model.safetensors")
    if kind == "shard":
        local = full[:, 1:3].contiguous()
        like = Shard.narrow("w", torch.zeros_like(local), full.shape, 1, 1)
    else:  # rows 4..5 then rows 0..1 (an out-of-order pair of runs)
        local = torch.cat([full[4:], full[:2]])
        like = Segments("w", torch.zeros_like(local), tuple(full.shape), ((16, 8), (0, 8)))
    sender = DeltaSender(["http://127.0.0.1:9"], "disk", tmp_path / "d")
    sender.seed_from_checkpoint(tmp_path, like=[like])
    assert torch.equal(
        sender.producer.snapshot_of("w").view(torch.int16), local.reshape(-1).view(torch.int16)
    )
    sender.close()


def test_refused_catchup_leaves_the_snapshot_as_it_was() -> None:
    """A catch-up that omits a param with unsent changes (or an anchor missing one) is refused before the
    scan: no bucket re-formed around the params given, no catch-up positions moved. A bucket that does
    re-form (a member rebound to new storage) carries its catch-up positions over to the new buckets."""
    buf = torch.arange(30, dtype=torch.float32)
    shards = [Shard.whole(n, buf[10 * i : 10 * i + 10].view(2, 5)) for i, n in enumerate("abc")]
    producer = Producer(snapshot="device")
    producer.seed(shards)
    buf[[1, 12, 23]] += 1
    producer.defer(producer.scan(shards, kind="delta", anchor=False))  # one bucket, a catch-up owed
    before = [(n, producer.snapshot_of(n).data_ptr()) for n in "abc"], producer.pending_names()
    with pytest.raises(ValueError, match="params with unsent changes were not given"):
        producer.scan(shards[:1], kind="catchup", anchor=False)
    with pytest.raises(ValueError, match="an anchor needs every param"):
        producer.scan(shards[:1], kind="", anchor=True)
    assert ([(n, producer.snapshot_of(n).data_ptr()) for n in "abc"], producer.pending_names()) == before
    cap = producer.scan(shards, kind="catchup", anchor=False)
    assert [e.positions.tolist() for e in cap.entries] == [[1], [2], [3]]
    moved = buf[:10].clone().view(2, 5)
    moved.view(-1)[4] += 1
    cap = producer.scan([Shard.whole("a", moved), *shards[1:]], kind="catchup", anchor=False)
    assert [e.positions.tolist() for e in cap.entries] == [[1, 4], [2], [3]]
    assert [e.new_values.tolist() for e in cap.entries] == [[2.0, 5.0], [13.0], [24.0]]
