"""The one-pass bucket scan (`sender/bucket_scan.py`): bit-exact against a plain-torch reference, shard by
shard, on a Megatron-like flat buffer (fused qkv rows as strided views, a split fc1, padding between
params, chunk edges) and on shards that take a bucket of their own (a transposed tensor, tied views, a
column slice of more runs than a table takes); its torch op count constant in the number of segments of
a bucket (counted with a TorchDispatchMode), every op on `meta`, and the offset map past 2^31 elements."""

from __future__ import annotations

import math

import pytest
import torch
from harness.dispatch_log import OpCount

import vllm_delta.diff as diff
from vllm_delta.sender import Shard, bucket_scan
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.shards import Segments
from vllm_delta.wire import additive

PAD = 7  # elements of padding after every param, as Megatron's buffer aligns params


def _buffer_segments(
    n_params: int, rows: int = 12, cols: int = 16, device: str = "cpu", gen: torch.Generator | None = None
) -> tuple[torch.Tensor, list[Segments]]:
    """A flat bf16 buffer of `n_params` params, each [rows, cols] with PAD after it, cut into HF
    tensors three ways: a strided view of every other row pair (qkv-like), the other rows as one
    HF tensor whose runs are out of HF order, and a whole param split in two (fc1-like)."""
    numel = rows * cols
    size = n_params * (numel + PAD)
    if device == "meta":
        buf = torch.empty(size, dtype=torch.bfloat16, device="meta")
    else:
        buf = (torch.randn(size, generator=gen) * 0.02).to(torch.bfloat16)
    segs = []
    for k in range(n_params):
        flat = buf[k * (numel + PAD) : k * (numel + PAD) + numel]
        p = flat.view(rows, cols)
        if k % 2 == 0:  # rows 0,1 / 4,5 / 8,9 -> "q" (strided view), rows 2,3 / 6,7 / 10,11 -> "kv"
            q = flat.as_strided((rows // 4, 2 * cols), (4 * cols, 1), flat.storage_offset())
            kv = flat.as_strided((rows // 4, 2 * cols), (4 * cols, 1), flat.storage_offset() + 2 * cols)
            half = numel // 2
            segs.append(
                Segments(
                    f"p{k}.q", q, (rows // 2, cols), tuple((i * 2 * cols, 2 * cols) for i in range(rows // 4))
                )
            )
            # kv's local runs land in reverse HF order: the sort by HF position is exercised
            segs.append(
                Segments(
                    f"p{k}.kv",
                    kv,
                    (rows // 2, cols),
                    tuple((half - (i + 1) * 2 * cols, 2 * cols) for i in range(rows // 4)),
                )
            )
        else:
            segs.append(Segments(f"p{k}.gate", p[: rows // 2], (rows // 2, cols), ((0, numel // 2),)))
            segs.append(Segments(f"p{k}.up", p[rows // 2 :], (rows // 2, cols), ((0, numel // 2),)))
    return buf, segs


def _perturb(buf: torch.Tensor, gen: torch.Generator, count: int, edges: list[int]) -> None:
    bits = buf.view(torch.int16)
    idx = torch.cat([torch.randint(0, buf.numel(), (count,), generator=gen), torch.tensor(edges)])
    bits[idx] += 1


class _Plain:
    """What the sender must answer, in plain torch shard by shard: the positions whose bits differ from
    the acknowledged snapshot, mapped by the shard's own `to_global`; digests by `additive.partial_sum`."""

    def __init__(self, segs) -> None:
        self.snap = {s.name: s.tensor.reshape(-1).clone() for s in segs}
        self.digest = {s.name: additive.partial_sum(s.global_index(), self.snap[s.name]) for s in segs}
        self.pending = {s.name: torch.zeros(0, dtype=torch.int64) for s in segs}
        self.scanned: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # changed positions, digest after

    def scan(self, segs, kind: str) -> dict[str, tuple]:
        out = {}
        for s in segs:
            cur, snap = s.tensor.reshape(-1), self.snap[s.name]
            local = torch.nonzero(cur.view(torch.int16) != snap.view(torch.int16)).reshape(-1)
            g = s.to_global(local)
            pre, post = additive.partial_sum(g, snap[local]), additive.partial_sum(g, cur[local])
            digests = {"digest": self.digest[s.name] - pre + post, "post_digest": post}
            self.scanned[s.name] = local, digests["digest"]
            send = local
            if kind == "catchup":
                send = torch.cat([local, self.pending[s.name]]).unique()
                digests["post_digest"] = additive.partial_sum(s.to_global(send), cur[send])
            if kind == "delta":
                digests["pre_digest"] = pre
            gs = s.to_global(send)
            order = torch.argsort(gs)
            out[s.name] = (
                local.numel(),
                gs[order].tolist(),
                cur[send][order].view(torch.int16).tolist(),
                snap[send][order].view(torch.int16).tolist() if kind == "delta" else None,
                {k: additive.to_hex(v) for k, v in digests.items()},
            )
        return out

    def settle(self, segs, ack: bool) -> None:
        for s in segs:
            local, digest = self.scanned[s.name]
            if ack:
                self.snap[s.name][local] = s.tensor.reshape(-1)[local]
                self.digest[s.name] = digest
                self.pending[s.name] = torch.zeros(0, dtype=torch.int64)
            else:
                self.pending[s.name] = torch.cat([self.pending[s.name], local]).unique()


def _entries(cap) -> dict[str, tuple]:
    return {
        e.name: (
            e.changed,
            e.positions.tolist(),
            e.new_values.view(torch.int16).tolist(),
            None if e.old_values is None else e.old_values.view(torch.int16).tolist(),
            {k: additive.to_hex(v) for k, v in e.digests.items()},
        )
        for e in cap.entries
    }


SYNCS = (
    ("delta", False, False),
    ("catchup", False, True),
    ("delta", False, False),
    ("catchup", True, True),
    ("delta", False, True),
)


def _run(segs, bufs: list[torch.Tensor], gen_seed: int, plain: bool) -> list[dict]:
    """Syncs (kind, anchor, acknowledged): deltas that lag (deferred), catch-ups, and an anchor (read
    piece by piece from the snapshot patched with the changes), by the producer or by `_Plain`."""
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in segs])
    model = _Plain(segs)
    gen = torch.Generator().manual_seed(gen_seed)
    out = []
    for kind, anchor, ack in SYNCS:
        for buf in bufs:
            _perturb(buf, gen, 300, [0, 999, 1000, 1001, buf.numel() - 1])  # diff chunk edges (1000 here)
        if plain:
            out.append(model.scan(segs, kind))
            model.settle(segs, ack)
            continue
        cap = producer.scan(segs, kind=kind, anchor=anchor)
        out.append(_entries(cap))
        if anchor:  # the anchor, read from the snapshot views, is the live weights in HF order
            for e, s in zip(cap.entries, segs):
                got = torch.zeros(math.prod(s.full_shape), dtype=torch.int16)
                for hf, piece in e.anchor.pieces(64):
                    got[hf : hf + piece.numel()] = piece.view(torch.int16)
                want = torch.zeros(math.prod(s.full_shape), dtype=torch.int16)
                want[s.global_index()] = s.tensor.reshape(-1).view(torch.int16)
                assert torch.equal(got, want), s.name
        (producer.advance if ack else producer.defer)(cap)
    snaps = model.snap if plain else {s.name: producer.snapshot_of(s.name) for s in segs}
    out.append({n: t.view(torch.int16).tolist() for n, t in snaps.items()})
    return out


def _own_bucket_shards(gen: torch.Generator) -> tuple[torch.Tensor, list[Shard]]:
    """Shards no shared bucket takes, over one buffer: a transposed tensor (inner stride 20), two
    names on the same tensor (tied), and a column slice of 12 runs (past MAX_RUNS, set to 8)."""
    other = (torch.randn(1200, generator=gen) * 0.02).to(torch.bfloat16)
    tied = other[480:720].view(12, 20)
    return other, [
        Shard.whole("t", other[:240].view(12, 20).t()),
        Shard.whole("e", tied),
        Shard.whole("h", tied),
        Shard.narrow("col", other[960:].view(12, 20)[:, 4:10], (12, 20), 1, 4),
    ]


@pytest.mark.parametrize("kernel", ["1", "0"])  # the fused CPU kernel (scan_kernel) and the torch path
def test_bucket_scan_is_bit_exact_with_plain_torch(monkeypatch, kernel: str) -> None:
    monkeypatch.setenv("VLLM_DELTA_KERNELS", kernel)
    monkeypatch.setattr(diff, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(bucket_scan, "MAX_RUNS", 8)
    gen = torch.Generator().manual_seed(1)
    buf, segs = _buffer_segments(6, gen=gen)
    other, own = _own_bucket_shards(gen)
    layouts = bucket_scan.plan(segs + own)
    assert [len(lay.names) for lay in layouts] == [len(segs), 1, 1, 1, 1]
    assert {lay.names[0]: lay.to_global is not None for lay in layouts[1:]} == {
        "t": False,
        "e": False,
        "h": False,
        "col": True,
    }
    start = buf.clone(), other.clone()
    got = _run(segs + own, [buf, other], 2, plain=False)
    buf.copy_(start[0])
    other.copy_(start[1])
    assert got == _run(segs + own, [buf, other], 2, plain=True)
    assert sum(e[0] for e in got[0].values()) > 250  # the changes hit members, not just padding
    assert all(got[0][s.name][0] for s in own)


def test_plain_tensors_and_row_shards_are_buckets_of_one() -> None:
    """DeltaSender.capture of a dict of tensors: each tensor is its own bucket, same answers as a
    plain torch diff."""
    gen = torch.Generator().manual_seed(3)
    ws = {f"w{i}": (torch.randn(40, 30, generator=gen)).to(torch.bfloat16) for i in range(3)}
    full = torch.randn(10, 30, generator=gen).to(torch.bfloat16)
    shards = [Shard.whole(k, v) for k, v in ws.items()] + [
        Shard.narrow("r", full[4:8].clone(), (10, 30), 0, 4)
    ]
    assert len(bucket_scan.plan(shards)) == 4
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in shards])
    before = {s.name: s.tensor.clone() for s in shards}
    for s in shards:
        s.tensor.view(-1)[::37] += 1
    cap = producer.scan(shards, kind="delta", anchor=False)
    for e, s in zip(cap.entries, shards):
        local = torch.nonzero(
            s.tensor.view(torch.int16).reshape(-1) != before[s.name].view(torch.int16).reshape(-1)
        )
        assert torch.equal(e.positions, s.to_global(local.reshape(-1)))
        assert torch.equal(e.new_values, s.tensor.reshape(-1)[local.reshape(-1)])


def _ops_per_sync(n_params: int, kind: str) -> int:
    buf, segs = _buffer_segments(n_params, gen=torch.Generator().manual_seed(4))
    producer = Producer(snapshot="device", post_hash=False)
    producer.seed([s.with_tensor(s.tensor.clone()) for s in segs])
    producer.defer(producer.scan(segs, kind="delta", anchor=False))  # builds the bucket; leaves a catch-up
    buf.view(torch.int16)[::50] += 1
    with OpCount() as ops:
        cap = producer.scan(segs, kind=kind, anchor=False)
        producer.advance(cap)
    return ops.count


@pytest.mark.parametrize("kind", ["delta", "catchup"])
def test_ops_per_sync_do_not_grow_with_the_segments_of_a_bucket(kind: str) -> None:
    counts = {n: _ops_per_sync(n, kind) for n in (2, 8, 32)}  # 4 to 64 segments in one buffer
    assert len(set(counts.values())) == 1, counts
    assert counts[2] < 150, counts  # the per-segment scan took ~85 per segment


def test_bucket_scan_runs_on_meta(meta_nonzero) -> None:
    """Every op of the bucket scan on meta: a table or temporary made on the CPU raises here."""
    _, segs = _buffer_segments(4, device="meta")
    assert len(bucket_scan.plan(segs)) == 1
    producer = Producer(snapshot="device", staging="meta", post_hash=False)
    producer.seed([s.with_tensor(torch.empty_like(s.tensor)) for s in segs])
    for kind in ("delta", "catchup", ""):
        cap = producer.scan(segs, kind=kind, anchor=False)
        assert len(cap.buckets) == 1
        for e in cap.entries:
            assert all(t.device.type == "meta" for t in (e.positions, e.new_values, *e.digests.values())), (
                e.name
            )
        producer.defer(cap)
    producer.advance(cap)


def test_offsets_past_two_to_the_31(meta_nonzero) -> None:
    """A bucket of 2^31 + 2^20 elements on meta, a member straddling 2^31 in the bucket and in its
    HF tensor: the layout and the scan build there, and the run table maps offsets on both sides of
    2^31 as the member's own `to_global` does (computed on the CPU from the same runs)."""
    big = (1 << 31) + (1 << 20)
    buf = torch.empty(big, dtype=torch.bfloat16, device="meta")
    a0 = (1 << 31) - 1000
    hf0 = (1 << 31) - 500  # HF positions straddle 2^31 too
    seg = Segments("x", buf[a0 : a0 + 4000], (1 << 32,), ((hf0, 1000), (0, 3000)))
    head = Segments("h", buf[:1000], (1000,), ((0, 1000),))
    (layout,) = bucket_scan.plan([head, seg])
    assert layout.names == ("h", "x")
    tables = bucket_scan.run_tables(layout.rows, torch.device("cpu"))
    pos = torch.tensor([0, 999, a0, a0 + 999, a0 + 1000, (1 << 31), a0 + 3999])
    member, hf, keep, _ = bucket_scan.locate(tables, pos)
    local = pos[2:] - a0
    cpu_seg = Segments("x", torch.empty(4000), (1 << 32,), seg.runs)
    assert member.tolist() == [0, 0, 1, 1, 1, 1, 1] and keep.all()
    assert torch.equal(hf[2:], cpu_seg.to_global(local)) and hf[:2].tolist() == [0, 999]
    assert not bucket_scan.locate(tables, torch.tensor([1000, a0 - 1]))[2].any()  # the gap
    producer = Producer(snapshot="device", staging="meta", post_hash=False)
    producer.seed(
        [head.with_tensor(torch.empty_like(head.tensor)), seg.with_tensor(torch.empty_like(seg.tensor))]
    )
    cap = producer.scan([head, seg], kind="delta", anchor=False)
    assert cap.buckets[0].bucket.snapshot.numel() == a0 + 4000


def test_chunked_diff_over_chunk_edges() -> None:
    """The accelerator's chunked diff on CPU tensors, chunk edges included, against plain torch."""
    gen = torch.Generator().manual_seed(6)
    snap = torch.randn(10_007, generator=gen).to(torch.bfloat16)
    cur = snap.clone()
    idx = torch.tensor([0, 999, 1000, 1001, 4999, 5000, 10_006])
    cur.view(torch.int16)[idx] ^= 1
    pos, old, new = bucket_scan.chunked_diff(cur, snap, 1000)
    assert torch.equal(pos, idx)
    assert torch.equal(old.view(torch.int16), snap.view(torch.int16)[idx])
    assert torch.equal(new.view(torch.int16), cur.view(torch.int16)[idx])


def test_auto_placement_counts_optimizer_state_and_a_margin() -> None:
    """At registration Adam's moments do not exist yet: a snapshot that fits in today's free memory
    but not beside them (and the margin) goes to the host, and the reason says why."""
    from vllm_delta.sender.producer import place_snapshot

    gib = 1 << 30
    params = 5 * gib  # bf16: a 10 GiB snapshot
    assert place_snapshot(2 * params, params, 60 * gib, 140 * gib)[0] == "host"  # 10 + 40 + 21 > 60
    place, why = place_snapshot(2 * params, params, 80 * gib, 140 * gib)
    assert place == "device" and "optimizer state 40.0 GiB" in why and "margin 21.0 GiB" in why
