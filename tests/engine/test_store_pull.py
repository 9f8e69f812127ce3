"""Engines pull a version from the object store: path confinement, the one-ahead fetch, and refusals
that leave the weights untouched.

Why in-process: the route's checks, the fetch generator and the worker's prepare are plain Python
over a real S3 server (moto on loopback, harness/s3_server.py, credentials enforced); the workers are
the real worker extension on two TP ranks of the tiny synthetic model, so no vLLM engine starts.
Objects are uploaded and tampered with by a plain boto3 client, independent of the code under test.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from harness.s3_server import s3_env, s3_server  # noqa: F401  (fixtures: a real local store)
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest, store_version_key
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.transports.s3 import StoreFlushes, fetch_manifest
from vllm_delta.transports.store import ObjectStore, StoreNotFound, StoreURL
from vllm_delta.wire import DeltaWriter, FileEntry, Lineage, load_manifest
from vllm_delta.wire.errors import IncompleteDeltaError

DC = device_check()
CFG = DC.SIZES["tiny"]
ROOT = StoreURL("bucket", "runs/a")

# ---- path confinement ------------------------------------------------------------------------

CONFINED = {
    "v000005": "runs/a/v000005",
    "v000006-anchor": "runs/a/v000006-anchor",
    "run_b/v000007": "runs/a/run_b/v000007",
}
OUTSIDE = [
    "/v000005",
    "/runs/a/v000005",
    "../v000005",
    "v1/../../b",
    "..",
    ".",
    "./v1",
    "a//b",
    "v1/",
    "",
    "a\\b",
    "v1\0",
    "s3://other-bucket/v1",
    "S3://bucket/runs/a/v1",
    "http://169.254.169.254/latest",
    "https://example.com/v1",
    "file:/etc/passwd",
    "file:v1",
    "%2e%2e/v1",
    "v1?x=1",
    "v1#f",
    "v 1",
]


@pytest.mark.parametrize("path", CONFINED)
def test_a_store_relative_path_becomes_a_key_under_the_root(path):
    assert store_version_key(path, ROOT) == CONFINED[path]
    assert store_version_key(path, StoreURL("bucket", "")) == path


@pytest.mark.parametrize("path", OUTSIDE)
def test_anything_else_is_outside_the_store_root(path):
    with pytest.raises(UpdateError) as err:
        store_version_key(path, ROOT)
    assert err.value.error["type"] == "PathOutsideRoot"


class UnreachedEngine:
    """Stands where the engine client would be: a refusal must come before any worker is asked."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the route reached the engine ({name})")


@pytest.mark.parametrize("path", [p for p in OUTSIDE if p])  # "" is refused by the body's schema
def test_the_route_refuses_a_path_outside_the_store_root_with_403(path):
    updater = DeltaUpdater(UnreachedEngine(), ROOT, 1 << 20, [])
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path=path, version=1)))
    assert err.value.status == 403 and err.value.error["type"] == "PathOutsideRoot"


def test_the_route_refuses_a_file_list_for_a_store_delta():
    updater = DeltaUpdater(UnreachedEngine(), ROOT, 1 << 20, [])
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v000001", version=1, files=["a.safetensors"])))
    assert err.value.status == 400


# ---- the fetch generator -----------------------------------------------------------------------


class RecordingStore(ObjectStore):
    """The real store client, recording which objects were asked for and signalling each arrival."""

    def __init__(self, url: StoreURL, names: list[str]) -> None:
        super().__init__(url)
        self.asked: list[str] = []
        self.arrived = {name: threading.Event() for name in names}

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        name = key.rsplit("/", 1)[-1]
        self.asked.append(name)
        try:
            return super().get(key, max_bytes=max_bytes)
        finally:
            if name in self.arrived:
                self.arrived[name].set()


NAMES = [f"rank0000_flush{i:06d}.safetensors" for i in range(4)]


@pytest.fixture
def objects(s3_env):
    """Four objects of different sizes under a fresh prefix: (store url, prefix, {name: bytes}, entries)."""
    url = StoreURL.parse(s3_env.url("fetch"))
    prefix = url.key("v000001")
    blobs = {name: bytes([i + 1]) * (1000 + 100 * i) for i, name in enumerate(NAMES)}
    client = s3_env.client()
    for name, data in blobs.items():
        client.put_object(Bucket=url.bucket, Key=f"{prefix}/{name}", Body=data)
    entries = [FileEntry(name=n, bytes=len(b), hash="unchecked-here") for n, b in blobs.items()]
    return url, prefix, blobs, entries


def fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vllm-delta-fetch")]


def test_one_flush_is_fetched_ahead_while_the_last_is_decoded(objects):
    url, prefix, blobs, entries = objects
    store = RecordingStore(url, NAMES)
    with StoreFlushes(store, prefix, entries) as flushes:
        for k, name in enumerate(NAMES):
            got = next(flushes)
            assert got == (name, blobs[name])
            if k + 1 < len(NAMES):  # while flush k is held, flush k+1 is fetched, and nothing after it
                assert store.arrived[NAMES[k + 1]].wait(30)
            assert store.asked == NAMES[: k + 2]
        with pytest.raises(StopIteration):
            next(flushes)
    assert flushes.fetched_bytes == sum(len(b) for b in blobs.values())
    assert fetch_threads() == []


def test_a_consumer_that_stops_early_stops_the_fetch_thread(objects):
    url, prefix, _, entries = objects
    store = RecordingStore(url, NAMES)
    flushes = StoreFlushes(store, prefix, entries)
    assert next(flushes)[0] == NAMES[0]
    flushes.close()
    assert fetch_threads() == []  # joined, not left running
    assert store.asked in (NAMES[:1], NAMES[:2])  # the one ahead may have been cancelled; never the rest


def test_a_missing_flush_object_is_refused_naming_it(objects, s3_env):
    url, prefix, _, entries = objects
    s3_env.client().delete_object(Bucket=url.bucket, Key=f"{prefix}/{NAMES[2]}")
    with StoreFlushes(ObjectStore(url), prefix, entries) as flushes:
        assert [next(flushes)[0] for _ in range(2)] == NAMES[:2]
        with pytest.raises(StoreNotFound) as err:
            next(flushes)
    assert err.value.file == NAMES[2] and err.value.http_status == 400


def test_a_version_without_its_manifest_is_unfinished(objects):
    url, prefix, _, _ = objects
    with pytest.raises(IncompleteDeltaError) as err:
        fetch_manifest(ObjectStore(url), prefix)
    assert err.value.file == "manifest.json"


# ---- the worker's prepare, through the route -----------------------------------------------------


def write_delta(path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int) -> None:
    """A delta old -> new in several small flushes, so the fetch runs ahead of the decoder."""
    with DeltaWriter(
        path, version=version, base_version=version - 1, encoding="ulp_zstd", flush_bytes=2048
    ) as writer:
        for name, t in new.items():
            a, b = old[name].reshape(-1), t.reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            if pos.numel():
                writer.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))


@pytest.fixture
def engine(tmp_path, s3_env, monkeypatch):
    """Two TP ranks on the checkpoint, a DeltaUpdater whose root is a fresh store prefix, and a
    version 1 uploaded there (flushes, then the manifest) by a plain client."""
    url = StoreURL.parse(s3_env.url("pull"))
    monkeypatch.setenv(ROOT_ENV, str(url))  # what `--delta-updates-root` exports to the workers
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2)
    write_delta(tmp_path / "v000001", base, new, version=1)
    names = [f.name for f in load_manifest(tmp_path / "v000001").files]
    assert len(names) >= 3
    client = s3_env.client()
    for name in [*names, "manifest.json"]:
        client.put_object(
            Bucket=url.bucket, Key=url.key("v000001", name), Body=(tmp_path / "v000001" / name).read_bytes()
        )
    updater = DeltaUpdater(InProcessEngine(workers), url, 1 << 20, [])
    return updater, url, models, workers, base, new, names


def pull(updater: DeltaUpdater, version: int = 1, base_version: int | None = 0) -> dict:
    return asyncio.run(
        updater.update(DeltaUpdateRequest(path=f"v{version:06d}", version=version, base_version=base_version))
    )


def unchanged(models, base) -> bool:
    return all(same_bits(m, loaded(base, rank, 2)) == [] for rank, m in enumerate(models))


def test_a_pushed_version_is_pulled_and_applied_exactly(engine, s3_env):
    updater, url, models, _, _, new, _ = engine
    result = pull(updater)
    assert result["version"] == 1
    assert all(same_bits(m, loaded(new, rank, 2)) == [] for rank, m in enumerate(models))
    sizes = s3_env.client().list_objects_v2(Bucket=url.bucket, Prefix=url.key("v000001") + "/")["Contents"]
    assert [r["bytes_read"] for r in result["ranks"]] == [
        sum(o["Size"] for o in sizes)
    ] * 2  # manifest + flushes


CORRUPTIONS = {
    "byte-flipped": lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:],
    "truncated": lambda d: d[:-1],
    "longer": lambda d: d + b"\0",
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupted_flush_is_refused_naming_it_and_nothing_is_written(engine, s3_env, corruption):
    updater, url, models, _, base, _, names = engine
    client, key = s3_env.client(), url.key("v000001", names[1])
    data = client.get_object(Bucket=url.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=url.bucket, Key=key, Body=CORRUPTIONS[corruption](data))
    with pytest.raises(UpdateError) as err:
        pull(updater)
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert err.value.error["file"] == names[1]
    assert unchanged(models, base) and not updater.engine.paused and updater.fault is None


def test_a_missing_flush_is_refused_naming_it_and_nothing_is_written(engine, s3_env):
    updater, url, models, _, base, _, names = engine
    s3_env.client().delete_object(Bucket=url.bucket, Key=url.key("v000001", names[-1]))
    with pytest.raises(UpdateError) as err:
        pull(updater)
    assert err.value.status == 400 and err.value.error["type"] == "StoreNotFound"
    assert err.value.error["file"] == names[-1]
    assert unchanged(models, base) and not updater.engine.paused


def test_a_version_without_its_manifest_is_refused_as_unfinished(engine, s3_env):
    updater, url, models, _, base, _, _ = engine
    s3_env.client().delete_object(Bucket=url.bucket, Key=url.key("v000001", "manifest.json"))
    with pytest.raises(UpdateError) as err:
        pull(updater)
    assert err.value.status == 400 and err.value.error["type"] == "IncompleteDeltaError"
    assert err.value.error["file"] == "manifest.json"
    assert unchanged(models, base)


@pytest.mark.parametrize("refusal", ["base-version", "other-lineage"])
def test_the_lineage_is_checked_before_any_flush_is_fetched(engine, s3_env, tmp_path, refusal):
    updater, url, models, workers, base, _, names = engine
    if refusal == "other-lineage":  # versions 3..3 of a run: not the checkpoint this engine is on
        manifest = load_manifest(tmp_path / "v000001")
        manifest = manifest.model_copy(update={"lineage": Lineage(run_id="r", min_version=3, max_version=3)})
        s3_env.client().put_object(
            Bucket=url.bucket,
            Key=url.key("v000001", "manifest.json"),
            Body=manifest.model_dump_json().encode(),
        )
    for w in workers:
        w._delta_store = RecordingStore(url, names)
    with pytest.raises(UpdateError) as err:
        pull(updater, base_version=5 if refusal == "base-version" else 0)  # the engine is at 0
    assert err.value.status == 409
    assert err.value.error["type"] == ("VersionError" if refusal == "base-version" else "LineageError")
    assert [w._delta_store.asked for w in workers] == [["manifest.json"]] * 2
    assert unchanged(models, base)
