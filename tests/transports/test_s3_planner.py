"""The S3 transport's sender side against a real S3 API (moto's server, in process) and HTTP fake
engines that pull each pushed version dir from the store and decode it for real.

What it pins: one upload per sync whatever the number of engines; the lifecycle (a version stays
until every engine moved past it; the kept chain stays for late joiners); a late joiner or restarted
engine replays the kept chain (anchor, then deltas) from the store instead of a new anchor upload,
and falls back to an anchor where the chain does not reach.
"""

from __future__ import annotations

import pytest
import torch
from harness.s3_server import prefix_of
from harness.store_engine import StoreFakeEngine
from sender.sender_helpers import adam_like_step

from vllm_delta import DeltaSender
from vllm_delta.wire import MANIFEST_NAME


@pytest.fixture
def world(s3_env, tmp_path, fake_weights):
    """(store URL of this test's own prefix, a factory of fake engines that pull from it)."""
    url = s3_env.url("planner")
    made: list[StoreFakeEngine] = []

    def engine(weights=fake_weights) -> StoreFakeEngine:
        made.append(StoreFakeEngine(s3_env, url, weights, tmp_path / f"cache{len(made)}"))
        return made[-1]

    yield url, engine
    for e in made:
        e.close()


@pytest.fixture
def fake_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16) for i in range(3)
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def stored(server, url: str) -> dict[str, int]:
    """Version dir -> total bytes of its objects, listed straight from the store."""
    out: dict[str, int] = {}
    prefix = prefix_of(url)
    for key, size in server.sizes(prefix + "/").items():
        d = key[len(prefix) + 1 :].split("/")[0]
        out[d] = out.get(d, 0) + size
    return out


def make(url: str, engines: list[StoreFakeEngine], keep_chain: int = 16) -> DeltaSender:
    sender = DeltaSender([e.url for e in engines], "s3", url, flush_bytes=1024, retries=0)
    sender.transport.keep_chain = keep_chain
    return sender


@pytest.mark.parametrize("n_engines", [1, 2])
def test_one_upload_and_a_late_joiner_replays_from_the_checkpoint(world, s3_env, fake_weights, n_engines):
    url, engine = world
    engines = [engine() for _ in range(n_engines)]
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(url, engines)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(1)
    for v in range(1, 4):
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
        assert m["sender/all_acked"] == 1.0
        assert m["perf/update_weights_upload_bytes"] == stored(s3_env, url)[f"v{v:06d}"], (
            "one upload, any engines"
        )
        assert all(e.version == v and same(e.weights, fake_weights) for e in engines)
    late = engine(seed)
    sender.add_engine(late.url)
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 0.0 and "v000004-anchor" not in stored(s3_env, url)
    assert [r["path"] for r in late.requests] == ["v000001", "v000002", "v000003", "v000004"]
    assert late.version == 4 and same(late.weights, fake_weights)
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in engines)
    assert m["perf/update_weights_upload_bytes"] == stored(s3_env, url)["v000004"]
    sender.remove_engine(late.url)  # the sender no longer drives it: not pushed, not waited for
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 1.0 and len(late.requests) == 4 and late.version == 4
    assert all(e.version == 5 and same(e.weights, fake_weights) for e in engines)
    assert m["perf/update_weights_upload_bytes"] == stored(s3_env, url)["v000005"]
    sender.close()


def test_restarted_engine_replays_the_latest_anchor_and_the_deltas_after_it(world, s3_env, fake_weights):
    url, engine = world
    a, b = engine(), engine()
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(url, [a, b])
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(2)
    for v in range(1, 5):
        if v == 2:
            sender.request_anchor()
        adam_like_step(fake_weights, gen)
        assert sender.sync(fake_weights)["sender/all_acked"] == 1.0
    # the latest anchor and every version after it are kept; before it, only what nobody needs is gone
    assert sorted(stored(s3_env, url)) == ["v000002-anchor", "v000003", "v000004"]
    b.restart(seed)
    sender.planner.engines[b.url].acked = None  # as after a failed push: ask its status
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 0.0 and m["sender/all_acked"] == 1.0
    assert [r["path"] for r in b.requests[-4:]] == ["v000002-anchor", "v000003", "v000004", "v000005"]
    assert all(e.version == 5 and same(e.weights, fake_weights) for e in (a, b))
    sender.close()


def test_a_version_stays_until_every_engine_moved_past_it(world, s3_env, fake_weights):
    url, engine = world
    a, b = engine(), engine()
    sender = make(url, [a, b], keep_chain=0)  # no chain: only the acks decide
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(3)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    b.fail_versions = {2}
    kept = []
    for _ in range(3):
        adam_like_step(fake_weights, gen)
        sender.sync(fake_weights)
        kept.append(sorted(stored(s3_env, url)))
    # v2: b failed it, so it stays until b acks a later version (the catch-up v3 at sync 3, seen at sync 4)
    assert kept == [["v000002"], ["v000002", "v000003"], ["v000004"]]
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in (a, b))
    sender.close()


@pytest.mark.parametrize("from_anchor", [False, True])
def test_a_chain_too_long_falls_back_to_an_anchor(world, s3_env, fake_weights, from_anchor):
    url, engine = world
    a = engine()
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(url, [a], keep_chain=2)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(4)
    if from_anchor:  # a chain of the anchor at v1 and 3 deltas after it
        sender.request_anchor()
    syncs = 4 if from_anchor else 3  # else: the checkpoint's chain of 3 deltas
    for _ in range(syncs):
        adam_like_step(fake_weights, gen)
        sender.sync(fake_weights)
    late = engine(seed)
    sender.add_engine(late.url)
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 1.0 and [r["path"] for r in late.requests] == [f"v{syncs + 1:06d}-anchor"]
    assert same(late.weights, fake_weights) and same(a.weights, fake_weights)
    sender.close()


def test_a_failed_upload_leaves_no_version_and_its_objects_go_at_the_next_sync(world, s3_env, fake_weights):
    """The store really goes down just before the manifest PUT of sync 2 (flushes in, no manifest):
    that sync raises, nothing is pushed; back up, sync 3 is exact and removes sync 2's objects."""
    from vllm_delta.transports.s3 import S3Transport
    from vllm_delta.transports.store import ObjectStore, StoreError

    url, engine = world
    a = engine()
    sender = make(url, [a])
    sender.transport.store = ObjectStore(sender.transport.url, max_attempts=1)  # fail fast, not in minutes
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(5)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    seal, down = S3Transport.seal, []

    def seal_after_outage(self, sent):
        if not down:
            s3_env.stop()  # the listening socket closed; moto keeps the objects for start()
            down.append(True)
        return seal(self, sent)

    try:
        S3Transport.seal = seal_after_outage
        adam_like_step(fake_weights, gen)
        with pytest.raises(StoreError, match="unreachable"):
            sender.sync(fake_weights)
    finally:
        S3Transport.seal = seal
        s3_env.start()
    assert [r["version"] for r in a.requests] == [1]
    left = s3_env.keys(f"{prefix_of(url)}/v000002/")
    assert left and f"{prefix_of(url)}/v000002/{MANIFEST_NAME}" not in left
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 1.0 and a.version == 3 and same(a.weights, fake_weights)
    assert sorted(stored(s3_env, url)) == ["v000001", "v000003"]  # the chain from the checkpoint
    sender.close()
