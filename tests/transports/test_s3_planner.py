"""The S3 transport's sender side against a real S3 API (moto's server, in process) and HTTP fake
engines that pull each pushed version dir from the store and decode it for real.

What it pins: one upload per sync whatever the number of engines; the lifecycle (a version stays
until every engine moved past it; the kept chain stays for late joiners); a late joiner or restarted
engine replays the kept chain (anchor, then deltas) from the store instead of a new anchor upload,
and falls back to an anchor where the chain does not reach.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sender.sender_helpers import FakeEngine, adam_like_step
from vllm_delta import DeltaSender
from vllm_delta.wire import MANIFEST_NAME

BUCKET = "s3-planner"


class StoreEngine(FakeEngine):
    """A fake engine whose root is the store: each push's version dir is pulled into a local cache
    first (only the objects that exist: a version without its manifest stays unfinished)."""

    def __init__(self, cache: Path, weights: dict[str, torch.Tensor], client, prefix: str) -> None:
        super().__init__(cache, weights)
        self.s3, self.prefix = client, prefix

    async def update(self, request):
        body = await request.json()
        local = self.root / body["path"]
        local.mkdir(parents=True, exist_ok=True)
        dir_key = f"{self.prefix}/{body['path']}/"
        for o in self.s3.list_objects_v2(Bucket=BUCKET, Prefix=dir_key).get("Contents", []):
            (local / o["Key"][len(dir_key):]).write_bytes(self.s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read())
        return await super().update(request)


@pytest.fixture(scope="module")
def endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer("127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def boto3_client():
    import boto3

    return boto3.client("s3")


@pytest.fixture
def s3(monkeypatch, endpoint):
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    client = boto3_client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def world(s3, tmp_path, request, fake_weights):
    prefix = f"run/{request.node.name}"
    made: list[StoreEngine] = []

    def engine(weights=fake_weights) -> StoreEngine:
        made.append(StoreEngine(tmp_path / f"cache{len(made)}", weights, s3, prefix))
        return made[-1]

    yield prefix, engine
    for e in made:
        e.close()


@pytest.fixture
def fake_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16) for i in range(3)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def stored(s3, prefix: str) -> dict[str, int]:
    """Version dir -> total bytes of its objects, listed straight from the store."""
    out: dict[str, int] = {}
    for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []):
        d = o["Key"][len(prefix) + 1:].split("/")[0]
        out[d] = out.get(d, 0) + o["Size"]
    return out


def make(prefix: str, engines: list[StoreEngine], keep_chain: int = 16) -> DeltaSender:
    sender = DeltaSender([e.url for e in engines], "s3", f"s3://{BUCKET}/{prefix}", flush_bytes=1024, retries=0)
    sender.transport.keep_chain = keep_chain
    return sender


@pytest.mark.parametrize("n_engines", [1, 2])
def test_one_upload_and_a_late_joiner_replays_from_the_checkpoint(world, s3, fake_weights, n_engines):
    prefix, engine = world
    engines = [engine() for _ in range(n_engines)]
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(prefix, engines)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(1)
    for v in range(1, 4):
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
        assert m["sender/all_acked"] == 1.0
        assert m["perf/update_weights_upload_bytes"] == stored(s3, prefix)[f"v{v:06d}"], "one upload, any engines"
        assert all(e.version == v and same(e.weights, fake_weights) for e in engines)
    late = engine(seed)
    sender.add_engine(late.url)
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 0.0 and "v000004-anchor" not in stored(s3, prefix)
    assert [r["path"] for r in late.requests] == ["v000001", "v000002", "v000003", "v000004"]
    assert late.version == 4 and same(late.weights, fake_weights)
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in engines)
    assert m["perf/update_weights_upload_bytes"] == stored(s3, prefix)["v000004"]
    sender.close()


def test_restarted_engine_replays_the_latest_anchor_and_the_deltas_after_it(world, s3, fake_weights):
    prefix, engine = world
    a, b = engine(), engine()
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(prefix, [a, b])
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(2)
    for v in range(1, 5):
        if v == 2:
            sender.request_anchor()
        adam_like_step(fake_weights, gen)
        assert sender.sync(fake_weights)["sender/all_acked"] == 1.0
    # the latest anchor and every version after it are kept; before it, only what nobody needs is gone
    assert sorted(stored(s3, prefix)) == ["v000002-anchor", "v000003", "v000004"]
    b.restart(seed)
    sender.planner.engines[b.url].acked = None  # as after a failed push: ask its status
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 0.0 and m["sender/all_acked"] == 1.0
    assert [r["path"] for r in b.requests[-4:]] == ["v000002-anchor", "v000003", "v000004", "v000005"]
    assert all(e.version == 5 and same(e.weights, fake_weights) for e in (a, b))
    sender.close()


def test_a_version_stays_until_every_engine_moved_past_it(world, s3, fake_weights):
    prefix, engine = world
    a, b = engine(), engine()
    sender = make(prefix, [a, b], keep_chain=0)  # no chain: only the acks decide
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(3)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    b.fail_versions = {2}
    kept = []
    for _ in range(3):
        adam_like_step(fake_weights, gen)
        sender.sync(fake_weights)
        kept.append(sorted(stored(s3, prefix)))
    # v2: b failed it, so it stays until b acks a later version (the catch-up v3 at sync 3, seen at sync 4)
    assert kept == [["v000002"], ["v000002", "v000003"], ["v000004"]]
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in (a, b))
    sender.close()


@pytest.mark.parametrize("from_anchor", [False, True])
def test_a_chain_too_long_falls_back_to_an_anchor(world, s3, fake_weights, from_anchor):
    prefix, engine = world
    a = engine()
    seed = {k: v.clone() for k, v in fake_weights.items()}
    sender = make(prefix, [a], keep_chain=2)
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


def test_a_failed_upload_leaves_no_version_and_its_objects_go_at_the_next_sync(s3, monkeypatch, tmp_path,
                                                                                  fake_weights):
    """The store really goes down just before the manifest PUT of sync 2 (flushes in, no manifest):
    that sync raises, nothing is pushed; back up, sync 3 is exact and removes sync 2's objects."""
    from moto.server import ThreadedMotoServer

    from vllm_delta.transports.s3 import S3Transport
    from vllm_delta.transports.store import ObjectStore, StoreError

    own = ThreadedMotoServer("127.0.0.1", port=0, verbose=False)  # moto keeps its objects across restarts
    own.start()
    port = own.get_host_and_port()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    a = StoreEngine(tmp_path / "cache", fake_weights, boto3_client(), "failed")
    sender = make("failed", [a])
    sender.transport.store = ObjectStore(sender.transport.url, max_attempts=1)  # fail fast, not in minutes
    sender.transport.attempts = 1
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(5)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    seal, down = S3Transport.seal, []

    def seal_after_outage(self, sent):
        if not down:
            own.stop()
            down.append(True)
        return seal(self, sent)

    try:
        S3Transport.seal = seal_after_outage
        adam_like_step(fake_weights, gen)
        with pytest.raises(StoreError, match="unreachable"):
            sender.sync(fake_weights)
    finally:
        S3Transport.seal = seal
        back = ThreadedMotoServer("127.0.0.1", port=port, verbose=False)
        back.start()
    try:
        assert [r["version"] for r in a.requests] == [1]
        left = [o["Key"] for o in a.s3.list_objects_v2(Bucket=BUCKET, Prefix="failed/v000002/")["Contents"]]
        assert left and f"failed/v000002/{MANIFEST_NAME}" not in left
        adam_like_step(fake_weights, gen)
        m = sender.sync(fake_weights)
        assert m["sender/all_acked"] == 1.0 and a.version == 3 and same(a.weights, fake_weights)
        assert sorted(stored(a.s3, "failed")) == ["v000001", "v000003"]  # the chain from the checkpoint
        sender.close()
    finally:
        a.close()
        back.stop()
