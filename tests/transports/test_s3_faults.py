"""Faults of the object-store transport against a real S3 server (in-process moto, IAM enforced).

Made for real: the store stopped mid-upload (its listening socket closed) and restarted, wrong keys
(moto checks the request signature), an object overwritten with other bytes, an object deleted, the
sender SIGKILLed between its upload and its push. Throttling cannot be produced by moto: a small
proxy (harness/fault_proxy.py) answers S3's own `503 SlowDown` for the next N requests in front of
it. Tests never assert a time: "quickly, never a hang" is asserted as a count of requests (a refused
credential is not retried), and every check reads the store with a plain boto3 client of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harness.fault_proxy import FaultProxy
from harness.s3_server import S3Server, prefix_of
from harness.store_engine import StoreFakeEngine
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks
from harness.vllm_engine import patched_environ
from safetensors.torch import save_file
from sender_helpers import adam_like_step  # tests/sender, on the path since harness.store_engine

from vllm_delta import DeltaSender
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.transports.store import ObjectStore, StoreAuthError, StoreError, StoreURL
from vllm_delta.wire import MANIFEST_NAME, load_manifest

MIB = 1 << 20
DC = device_check()


@pytest.fixture
def proxy(s3_server: S3Server):
    p = FaultProxy(s3_server.endpoint)
    yield p
    p.close()


def store_at(
    server: S3Server, url: str, *, endpoint: str | None = None, secret_key: str | None = None, **kwargs
) -> ObjectStore:
    """An ObjectStore configured only through the standard AWS environment, as a user's would be."""
    with patched_environ(server.env(endpoint=endpoint, secret_key=secret_key)):
        return ObjectStore(StoreURL.parse(url), **kwargs)


def read_back(server: S3Server, key: str) -> bytes:
    return server.client().get_object(Bucket=server.bucket, Key=key)["Body"].read()


# ---- throttling (the one injected fault) ---------------------------------------------------------
def test_slow_down_is_retried_on_put_multipart_and_get(s3_server, proxy):
    url = s3_server.url("slowdown")
    store = store_at(s3_server, url, endpoint=proxy.url, part_bytes=5 * MIB)
    data = bytes(range(256)) * (11 * MIB // 256)  # 3 parts of a multipart upload
    key = StoreURL.parse(url).key("v000001", "flush.safetensors")
    proxy.slow_down(1)
    store.put(key, data)
    assert proxy.injected == 1 and proxy.requests == 1 + 5  # a refusal, then create, 3 parts, complete
    assert read_back(s3_server, key) == data and store.uploaded_bytes == len(data)
    proxy.slow_down(1)
    assert store.get(key) == data and proxy.injected == 2


def test_slow_down_past_the_retry_budget_is_a_store_error_naming_the_key(s3_server, proxy):
    url = s3_server.url("slowdown-budget")
    store = store_at(s3_server, url, endpoint=proxy.url, max_attempts=1)
    key = StoreURL.parse(url).key("v000001", "manifest.json")
    proxy.slow_down(10)
    with pytest.raises(StoreError) as err:
        store.put(key, b"{}")
    assert not isinstance(err.value, StoreAuthError) and err.value.file == key
    # Retried, then it gives up (botocore's `max_attempts` counts the retries after the first request).
    assert proxy.injected == 2
    proxy.slow_down(0)
    assert s3_server.keys(prefix_of(url)) == []


# ---- wrong credentials: refused at once, clearly, without the secret ------------------------------
@pytest.mark.parametrize("bad", ["secret", "access_key"])
def test_wrong_credentials_are_a_clear_auth_error_at_the_first_request(s3_server, proxy, bad):
    url = s3_server.url("auth")
    secret = "wrong-secret-do-not-print"
    env = s3_server.env(
        endpoint=proxy.url,
        secret_key=secret,
        access_key="AKIANOTAREALKEY00000" if bad == "access_key" else None,
    )
    with patched_environ(env):
        store = ObjectStore(StoreURL.parse(url))
    with pytest.raises(StoreAuthError) as err:
        store.check_access()
    assert proxy.requests == 1, "a refused credential is never retried (no hang)"
    assert err.value.http_status == 502 and "credentials" in str(err.value)
    assert secret not in str(err.value) and secret not in repr(err.value.__dict__)
    with pytest.raises(StoreAuthError):
        store.put(StoreURL.parse(url).key("v000001", "manifest.json"), b"{}")
    assert proxy.requests == 2 and s3_server.keys(prefix_of(url)) == []


# ---- the store down ------------------------------------------------------------------------------
def test_store_stopped_is_a_store_error_after_bounded_retries(s3_server, proxy):
    """The proxy stopped (connections refused): the put gives up after its retries with a StoreError."""
    url = s3_server.url("down")
    store = store_at(s3_server, url, endpoint=proxy.url, max_attempts=1)
    proxy.stop()
    try:
        with pytest.raises(StoreError) as err:
            store.put(StoreURL.parse(url).key("v000001", "f"), b"x")
        assert "unreachable" in str(err.value) and not isinstance(err.value, StoreAuthError)
    finally:
        proxy.start()
    assert proxy.requests == 0


def test_store_restarted_within_the_retries_completes_the_upload(s3_server):
    """The real server stopped (socket closed) before a put and started again while botocore retries."""
    url = s3_server.url("restart")
    store = store_at(s3_server, url, part_bytes=5 * MIB)
    key = StoreURL.parse(url).key("v000001", "flush.safetensors")
    data = b"\x5a" * (6 * MIB)  # multipart: two parts
    s3_server.stop()
    restart = threading.Timer(1.0, s3_server.start)
    restart.start()
    try:
        store.put(key, data)
    finally:
        restart.join()
    assert read_back(s3_server, key) == data


# ---- the engine side: a corrupted or missing object is refused, naming it, and nothing changes ----
def write_flushes(path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[str]:
    """A delta old -> new in small flushes (several objects) with the sender's digests; its flush names."""
    DC.write_delta(path, old, new, version=1, flush_bytes=4 << 10)
    return [f.name for f in load_manifest(path).files]


@pytest.fixture
def store_engine(s3_env, tmp_path):
    """A TP=1 engine of the synthetic model (the real worker extension and route) on a store root,
    and a sealed delta for it uploaded by a plain boto3 client: (updater, model, base, new, url, flushes)."""
    base = DC.random_checkpoint(DC.SIZES["tiny"], "cpu", seed=0)
    new = DC.step(base, 0.2, seed=1)
    flushes = write_flushes(tmp_path / "v000001", base, new)
    assert len(flushes) >= 3
    url = s3_env.url("engine")
    for f in sorted((tmp_path / "v000001").iterdir()):
        s3_env.client().put_object(
            Bucket=s3_env.bucket, Key=f"{prefix_of(url)}/v000001/{f.name}", Body=f.read_bytes()
        )
    models, workers = tp_ranks(tmp_path / "model", base, tp=1)
    with patched_environ({ROOT_ENV: url}):  # what --delta-updates-root exports to the workers
        updater = DeltaUpdater(InProcessEngine(workers), StoreURL.parse(url), 1 << 20, [])
        yield updater, models[0], base, new, url, flushes


def push(updater: DeltaUpdater) -> dict:
    return asyncio.run(updater.update(DeltaUpdateRequest(path="v000001", version=1, base_version=0)))


def refused(updater: DeltaUpdater) -> dict:
    with pytest.raises(UpdateError) as err:
        push(updater)
    return {"status": err.value.status, **err.value.error}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_corrupted_object_is_refused_naming_it_and_the_engine_is_unchanged(s3_env, store_engine, where):
    updater, model, base, new, url, flushes = store_engine
    name = {"first": flushes[0], "middle": flushes[len(flushes) // 2], "last": flushes[-1]}[where]
    key = f"{prefix_of(url)}/v000001/{name}"
    good = read_back(s3_env, key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01  # one bit, same size: only the file hash can tell
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(bad))
    err = refused(updater)
    assert err["status"] == 400 and err["type"] == "IntegrityError" and err["file"] == name, err
    assert same_bits(model, loaded(base, 0, 1)) == [] and updater.fault is None
    s3_env.client().put_object(
        Bucket=s3_env.bucket, Key=key, Body=good
    )  # the sender's bytes again: it applies
    assert push(updater)["version"] == 1 and same_bits(model, loaded(new, 0, 1)) == []


def test_missing_object_is_refused_naming_it_and_the_engine_is_unchanged(s3_env, store_engine):
    updater, model, base, new, url, flushes = store_engine
    name = flushes[1]
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=f"{prefix_of(url)}/v000001/{name}")
    err = refused(updater)
    assert err["status"] == 400 and err["type"] == "StoreNotFound" and err["file"] == name, err
    assert name in err["message"]
    assert same_bits(model, loaded(base, 0, 1)) == [] and updater.fault is None


def test_version_without_its_manifest_is_invisible(s3_env, store_engine):
    updater, model, base, new, url, flushes = store_engine
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=f"{prefix_of(url)}/v000001/{MANIFEST_NAME}")
    err = refused(updater)
    assert err["status"] == 400 and err["type"] == "IncompleteDeltaError" and err["file"] == MANIFEST_NAME, (
        err
    )
    assert same_bits(model, loaded(base, 0, 1)) == []


# ---- the sender: the store down mid-upload, wrong keys, killed between upload and push -----------
def weights_and_step(
    density: float, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = {
        f"layer{i}.weight": (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16) for i in range(3)
    }
    new = {k: v.clone() for k, v in base.items()}
    adam_like_step(new, gen, density)
    return base, new


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def test_store_down_mid_upload_is_retried_and_no_engine_sees_a_half_version(s3_env, tmp_path):
    """The real server stopped while the sender's uploader has put some flushes (no manifest yet), and
    started again a second later: the sync completes exactly; the engine was pushed once, after the seal."""
    url = s3_env.url("midupload")
    base, new = weights_and_step(0.5)
    engine = StoreFakeEngine(s3_env, url, base, tmp_path / "engine")
    seen: dict[str, list[str]] = {}
    sender = DeltaSender([engine.url], "s3", url, flush_bytes=16 << 10, throttle_bytes_per_s=256 << 10)
    sender.seed(base.items())
    vdir = f"{prefix_of(url)}/v000001/"

    def outage() -> None:
        while not any(k.endswith(".safetensors") for k in s3_env.keys(vdir)):
            time.sleep(0.01)
        seen["at_stop"] = s3_env.keys(vdir)
        seen["pushes_at_stop"] = list(engine.requests)
        s3_env.stop()
        time.sleep(0.5)
        s3_env.start()

    t = threading.Thread(target=outage)
    t.start()
    try:
        m = sender.sync(new.items())
    finally:
        t.join()
        engine.close()
    assert seen["at_stop"] and f"{vdir}{MANIFEST_NAME}" not in seen["at_stop"], seen
    assert seen["pushes_at_stop"] == []
    keys = s3_env.keys(vdir)
    assert f"{vdir}{MANIFEST_NAME}" in keys and len(keys) > len(seen["at_stop"]), (
        "flushes went on after the restart"
    )
    assert m["sender/all_acked"] == 1.0 and [r["version"] for r in engine.requests] == [1]
    assert same(engine.weights, new)


def test_wrong_credentials_fail_the_first_sync_clearly_and_nothing_is_pushed(s3_server, proxy, tmp_path):
    url = s3_server.url("sender-auth")
    base, new = weights_and_step(0.05)
    engine = StoreFakeEngine(s3_server, url, base, tmp_path / "engine")
    try:
        with patched_environ(s3_server.env(endpoint=proxy.url, secret_key="wrong-secret-do-not-print")):
            sender = DeltaSender([engine.url], "s3", url)
        sender.seed(base.items())
        with pytest.raises(StoreAuthError) as err:
            sender.sync(new.items())
    finally:
        engine.close()
    assert "credentials" in str(err.value) and "wrong-secret-do-not-print" not in str(err.value)
    assert proxy.requests == 1, proxy.seen  # refused once, not retried: no hang
    assert engine.requests == [] and s3_server.keys(prefix_of(url)) == []


KILLED_AFTER_SEAL = """
import os, signal, sys, time
from safetensors.torch import load_file
from vllm_delta import DeltaSender
from vllm_delta.transports.s3 import S3Transport
engine, url, weights, marker = sys.argv[1:5]
def stall(self, client, targets):  # sealed, about to push: tell the test, then wait to be killed
    open(marker, "w").close()
    time.sleep(600)
S3Transport.push = stall
w = load_file(weights)
s = DeltaSender([engine], "s3", url, flush_bytes=16 << 10)
s.seed((k[5:], v) for k, v in w.items() if k.startswith("base."))
s.sync((k[4:], v) for k, v in w.items() if k.startswith("new."))
"""


@pytest.mark.heavy
def test_sender_killed_between_upload_and_push_then_next_sync_is_exact(s3_env, tmp_path):
    """A sender process SIGKILLed with its version sealed in the store but never pushed: a new sender
    from the engines' version re-uploads that version over the orphan, and the engine ends exact."""
    url = s3_env.url("killed")
    base, new = weights_and_step(0.2, seed=1)
    other = {k: v.clone() for k, v in base.items()}  # the new sender's trainer: not the dead one's step
    adam_like_step(other, torch.Generator().manual_seed(3), 0.2)
    engine = StoreFakeEngine(s3_env, url, base, tmp_path / "engine")
    save_file(
        {**{f"base.{k}": v for k, v in base.items()}, **{f"new.{k}": v for k, v in new.items()}},
        str(tmp_path / "w.safetensors"),
    )
    marker = tmp_path / "sealed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_AFTER_SEAL,
            engine.url,
            url,
            str(tmp_path / "w.safetensors"),
            str(marker),
        ],
        env={**os.environ, **s3_env.env()},
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the sender never sealed (exit {proc.poll()})"
        orphan = s3_env.keys(f"{prefix_of(url)}/v000001/")
        assert (
            f"{prefix_of(url)}/v000001/{MANIFEST_NAME}" in orphan
        )  # sealed: a complete version, never pushed
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert engine.requests == []
        sender = DeltaSender([engine.url], "s3", url, flush_bytes=16 << 10)
        sender.seed(base.items())
        m = sender.sync(other.items())
        assert m["sender/all_acked"] == 1.0 and [r["version"] for r in engine.requests] == [1]
        assert same(engine.weights, other) and not same(engine.weights, new)
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.close()
