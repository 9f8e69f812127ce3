"""The sender's ack-gated state machine against real HTTP fake engines that decode real deltas.

Fast (no vLLM): every engine must end bit-identical to the trainer after each sync it acked, a
failed engine converges at the next sync, a restarted one is anchored, one pushed ahead is
overtaken, and the healthy engine never regresses.
"""

from __future__ import annotations

import json

import pytest
import torch
from sender_helpers import adam_like_step

from vllm_delta import DeltaSender
from vllm_delta.wire import MANIFEST_NAME


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def make(tmp_path, engines, **kw) -> DeltaSender:
    return DeltaSender([e.url for e in engines], "disk", tmp_path, flush_bytes=1024, retries=0, **kw)


@pytest.mark.parametrize("encoding", ["ulp_zstd", "deltas_zstd"])
@pytest.mark.parametrize("as_iter", [False, True])
def test_steady_state_bit_exact(tmp_path, fake_engines, fake_weights, encoding, as_iter):
    sender = make(tmp_path, fake_engines, encoding=encoding)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(1)
    for v in range(1, 5):
        adam_like_step(fake_weights, gen)
        m = sender.sync(iter(fake_weights.items()) if as_iter else fake_weights)
        assert m["sender/all_acked"] == 1.0 and m["sender/catchup"] == 0.0
        assert sender.snapshot_version == v
        for e in fake_engines:
            assert e.version == v and same(e.weights, fake_weights)
            assert e.requests[-1]["base_version"] == (v - 1 if encoding == "ulp_zstd" else None)
        assert 0.03 < m["perf/update_weights_density"] < 0.07
        assert m["perf/update_weights_flushes_per_rank"] > 1
    assert not list(tmp_path.iterdir()), "version directories are deleted after every ack"


def test_failed_engine_converges_and_healthy_never_regresses(tmp_path, fake_engines, fake_weights):
    a, b = fake_engines
    sender = make(tmp_path, fake_engines, max_pending_density=1.0)  # the catch-up, not a drop
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(2)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    b.fail_versions = {2}
    before = {k: v.clone() for k, v in fake_weights.items()}
    adam_like_step(fake_weights, gen, density=0.3)  # dense enough that some positions revert below
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 0.0 and m["sender/engines_failed"] == 1.0
    assert a.version == 2 and same(a.weights, fake_weights)
    assert b.version == 1 and same(b.weights, before)
    assert sender.snapshot_version == 1, "the snapshot must not advance past a failed engine"
    # Revert part of the failed step: these positions equal the snapshot again but not engine a.
    for k in fake_weights:
        fake_weights[k].view(-1)[:500] = before[k].view(-1)[:500]
        fake_weights[k].view(-1)[:200] = sender.producer.snapshot_of(k)[:200]
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/catchup"] == 1.0 and m["sender/all_acked"] == 1.0
    for e in fake_engines:
        assert e.version == 3 and same(e.weights, fake_weights)
    assert a.requests[-1]["base_version"] is None  # overwrite catch-up
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/catchup"] == 0.0 and all(same(e.weights, fake_weights) for e in fake_engines)
    assert [r["version"] for r in a.requests] == [1, 2, 3, 4]


def test_engines_missing_several_syncs_are_caught_up_by_one_overwrite(tmp_path, fake_engines, fake_weights):
    """b misses v2 and v3, a only v3: what was sent since S adds up over both misses, so the positions
    v2 changed and v3 moved back to the snapshot (no longer in diff(N, S)) still reach a, which holds
    v2's values there; one catch-up at v4 takes a (at v2) and b (at S = v1) exactly to v4."""
    a, b = fake_engines
    sender = make(tmp_path, fake_engines, max_lag_syncs=10, max_pending_density=1.0)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(7)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    a.fail_versions, b.fail_versions = {3}, {2, 3}
    adam_like_step(fake_weights, gen, density=0.3)
    sender.sync(fake_weights)
    adam_like_step(fake_weights, gen)
    for k in fake_weights:  # back to the snapshot (v1) where v2 moved them: only the pending set lists these
        fake_weights[k].view(-1)[:1500] = sender.producer.snapshot_of(k)[:1500]
    m = sender.sync(fake_weights)
    assert m["sender/engines_acked"] == 0.0 and (a.version, b.version, sender.snapshot_version) == (2, 1, 1)
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/catchup"] == 1.0 and m["sender/all_acked"] == 1.0 and sender.snapshot_version == 4
    for e in fake_engines:
        assert e.version == 4 and same(e.weights, fake_weights)


def test_restarted_engine_is_anchored(tmp_path, fake_engines, fake_weights):
    a, b = fake_engines
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(tmp_path, fake_engines)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        adam_like_step(fake_weights, gen)
        sender.sync(fake_weights)
    b.restart(seed)  # back at version 0 with the checkpoint's weights
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)  # b refuses the base-relative delta (409)
    assert m["sender/all_acked"] == 0.0 and b.version == 0
    assert sender.engines[b.url].last_status == 409
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 1.0 and m["sender/all_acked"] == 1.0
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in fake_engines)


def test_engine_pushed_ahead_is_overtaken(tmp_path, fake_engines, fake_weights):
    a, b = fake_engines
    sender = make(tmp_path, fake_engines)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(4)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    b.version = 10  # someone else pushed version 10
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 0.0 and sender.engines[b.url].last_status == 409
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/version"] == 11.0 and m["sender/all_acked"] == 1.0
    assert all(e.version == 11 and same(e.weights, fake_weights) for e in fake_engines)


def test_anchor_every_and_duplicate_push(tmp_path, fake_engines, fake_weights):
    sender = make(tmp_path, fake_engines, anchor_every=2, keep=True)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(5)
    for _ in (1, 2):
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 2.0 and (tmp_path / "v000002-anchor" / MANIFEST_NAME).exists()
    assert all(same(e.weights, fake_weights) for e in fake_engines)
    # A duplicate push of an overwrite anchor is idempotent.
    a = fake_engines[0]
    import requests

    r = requests.post(
        f"{a.url}/update_weights_delta", json={"path": "v000002-anchor", "version": 2}, timeout=30
    )
    assert r.status_code == 200 and same(a.weights, fake_weights)
    r = requests.post(
        f"{a.url}/update_weights_delta", json={"path": "v000001", "version": 1, "base_version": 0}, timeout=30
    )
    assert r.status_code == 409  # out of order


def test_metrics_match_bytes_on_disk(tmp_path, fake_engines, fake_weights):
    sender = make(tmp_path, fake_engines, keep=True)
    sender.seed(fake_weights)
    adam_like_step(fake_weights, torch.Generator().manual_seed(6))
    m = sender.sync(fake_weights)
    d = tmp_path / "v000001"
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    files = sorted(d.glob("rank*_flush*.safetensors"))
    assert len(files) == m["perf/update_weights_flushes_per_rank"] == len(manifest["files"])
    on_disk = sum(f.stat().st_size for f in files)
    assert m["perf/update_weights_wire_bytes"] == on_disk == m["perf/update_weights_disk_bytes_post_compress"]
    assert m["perf/update_weights_disk_bytes_pre_compress"] == sum(
        f["decoded_bytes"] for f in manifest["files"]
    )
    assert m["perf/update_weights_compression_ratio"] == pytest.approx(
        m["perf/update_weights_disk_bytes_pre_compress"] / on_disk
    )
    total = sum(t.numel() for t in fake_weights.values())
    assert m["perf/update_weights_density"] == pytest.approx(
        sum(p["changed"] for p in manifest["params"]) / total
    )
    assert not list(d.glob("*.tmp"))


def test_engine_down_for_k_syncs_drops_to_anchor_and_healthy_keep_deltas(
    tmp_path, fake_engines, fake_weights
):
    """Bounded lag: after `max_lag_syncs` misses the snapshot moves on without the engine, the healthy
    one is back on base-relative deltas, and the returning engine is anchored and converges."""
    a, b = fake_engines
    sender = make(tmp_path, fake_engines, max_lag_syncs=2, max_pending_density=1.0)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(5)
    b.fail_versions = {1, 2}
    kinds = []
    for v in range(1, 5):
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
        kinds.append((m["sender/catchup"], m["sender/anchors"], sender.snapshot_version))
        assert a.version == v and same(a.weights, fake_weights)
    # v1: b fails (miss 1, snapshot held at 0); v2: catch-up, b fails again (miss 2: dropped, snapshot
    # moves to 2); v3: a gets a base-relative delta, b (answering again) an anchor; v4: steady state.
    assert kinds == [(0.0, 0.0, 0), (1.0, 0.0, 2), (0.0, 1.0, 3), (0.0, 0.0, 4)]
    assert a.requests[2]["base_version"] == 2 and b.requests[2]["path"].endswith("-anchor")
    assert b.version == 4 and same(b.weights, fake_weights)
    assert m["sender/pending_density"] == 0.0


def test_dense_pending_catchup_drops_the_laggard(tmp_path, fake_engines, fake_weights):
    a, b = fake_engines
    sender = make(tmp_path, fake_engines, max_lag_syncs=100, max_pending_density=0.08)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(6)
    b.fail_versions = {1, 2}
    seen = []
    for _ in range(3):
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
        seen.append((m["sender/pending_density"], m["sender/dropped_to_anchor"], sender.snapshot_version))
    # ~5% per step: the pending set passes 8% at the second sync; b is dropped, the snapshot moves.
    assert seen[0][0] > 0.03 and seen[0][1:] == (0.0, 0)
    assert seen[1] == (0.0, 1.0, 2)
    assert seen[2] == (0.0, 0.0, 3) and m["sender/catchup"] == 0.0 and m["sender/anchors"] == 1.0
    assert a.version == b.version == 3 and same(a.weights, fake_weights) and same(b.weights, fake_weights)
