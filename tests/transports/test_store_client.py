"""ObjectStore against a real S3 API (moto's server, in process, on loopback): multipart puts, ranged
gets, listing and deleting one version directory, and the errors callers map to statuses.

The broader store tests (retries on 503, wrong keys, the server stopped mid-upload) live with the
shared server fixture; these are the client's own basics, each a few requests.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter

import pytest

from vllm_delta.transports.store import (
    ObjectStore,
    StoreAuthError,
    StoreError,
    StoreNotFound,
    StoreURL,
    is_store_url,
)
from vllm_delta.wire.errors import LimitError

BUCKET = "store-client"


@pytest.fixture
def store(s3_env, request):
    s = ObjectStore(
        StoreURL.parse(f"s3://{BUCKET}/run/{request.node.name}"), part_bytes=1 << 20, max_concurrency=4
    )
    if BUCKET not in {b["Name"] for b in s.client.list_buckets()["Buckets"]}:
        s.client.create_bucket(Bucket=BUCKET)
    calls: Counter = Counter()
    s.client.meta.events.register("before-call.s3", lambda model, **kw: calls.update([model.name]))
    s.calls = calls
    return s


def test_url_parse():
    u = StoreURL.parse("s3://bkt/a/b/")
    assert (u.bucket, u.prefix, str(u), u.key("v000001", "manifest.json")) == (
        "bkt",
        "a/b",
        "s3://bkt/a/b",
        "a/b/v000001/manifest.json",
    )
    assert StoreURL.parse("s3://bkt").key("v1") == "v1" and str(StoreURL.parse("s3://bkt")) == "s3://bkt"
    for bad in ("bkt/a", "http://bkt/a", "s3://", "s3:///a", "s3://bkt/a/../b", "s3://bkt/a//b"):
        with pytest.raises(ValueError):
            StoreURL.parse(bad)
    assert is_store_url("s3://x") and not is_store_url("/mnt/s3://x")


def test_multipart_put_and_parallel_ranged_get(store):
    data = os.urandom((11 << 20) + 1)  # 3 multipart parts of S3's minimum 5 MiB; 12 ranged GETs of 1 MiB
    key = store.url.key("v000001", "flush-0")
    store.put(key, data)
    assert store.uploaded_bytes == len(data)
    head = store.client.head_object(Bucket=BUCKET, Key=key)
    assert head["ETag"].strip('"').endswith("-3"), "a multipart object of 3 parts"
    assert store.calls["UploadPart"] == 3 and store.calls["PutObject"] == 0
    assert hashlib.sha256(store.get(key)).digest() == hashlib.sha256(data).digest()
    assert store.calls["GetObject"] == 12
    assert store.head(key)[0] == len(data)
    assert store.get_range(key, (1 << 20) - 1, (1 << 20) + 1) == data[(1 << 20) - 1 : (1 << 20) + 1]
    assert store.get_range(key, len(data) - 1, len(data)) == data[-1:]
    assert store.get_range(key, 7, 7) == b""


def test_small_objects_list_and_delete_one_version(store):
    for name in ("v000001/a", "v000001/manifest.json", "v000001-anchor/a", "v000002/a"):
        store.put(store.url.key(name), name.encode())
    store.put(store.url.key("v000002/empty"), b"")
    assert store.calls["PutObject"] == 5 and store.calls["CreateMultipartUpload"] == 0
    assert store.get(store.url.key("v000002/empty")) == b""
    assert store.get(store.url.key("v000001/a")) == b"v000001/a"
    assert store.uploaded_bytes == sum(
        len(n) for n in ("v000001/a", "v000001/manifest.json", "v000001-anchor/a", "v000002/a")
    )
    # "v000001/" must not reach the sibling "v000001-anchor/"
    assert store.delete_prefix(store.url.key("v000001") + "/") == 2
    assert sorted(store.list(store.url.key(""))) == [
        store.url.key(n) for n in ("v000001-anchor/a", "v000002/a", "v000002/empty")
    ]


def test_missing_object_and_size_cap(store):
    key = store.url.key("v000003", "manifest.json")
    with pytest.raises(StoreNotFound) as e:
        store.get(key)
    assert e.value.file == key and e.value.http_status == 400
    store.put(key, b"x" * 100)
    with pytest.raises(LimitError):
        store.get(key, max_bytes=99)
    assert store.calls["GetObject"] == 0, "an object over the cap is never read"
    assert store.get(key, max_bytes=100) == b"x" * 100
    store.check_access()
    with pytest.raises(StoreNotFound, match="no such bucket"):
        ObjectStore(StoreURL.parse("s3://no-such-bucket-here")).check_access()


def test_unreachable_store_is_a_clear_error(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    s = ObjectStore(StoreURL.parse(f"s3://{BUCKET}/x"), max_attempts=2)
    with pytest.raises(StoreError) as e:
        s.check_access()
    assert not isinstance(e.value, (StoreAuthError, StoreNotFound)) and e.value.http_status == 502
    assert "unreachable at http://127.0.0.1:9" in str(e.value) and s3_env.secret_key not in str(e.value)
