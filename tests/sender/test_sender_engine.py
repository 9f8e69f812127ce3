"""DeltaSender against a real `vllm serve` (CPU): a plain PyTorch trainer syncs after every step over
disk (over gloo: test_collective_engine.py), and the faults of issue 5 are produced for real.

One server (the session's shared Llama engine, put back on its checkpoint when the module starts)
and one trainer serve the module (engine starts are the cost). Each test starts from what the
engine holds now (its status version, the trainer's weights) and leaves the engine on the trainer's
weights, so the tests pass alone and in any order. The equality test syncs one more step (so it is
not tautological when run alone) and loads the checkpoint the trainer saves afresh with vLLM's own
loader (harness/fresh_load), whose digests must equal the synced engine's `/weight_checker` digests
and differ from the base checkpoint's. Every update carries per-tensor post-apply hashes, so each
sync is also verified bit-exact by the engine itself (a mismatch is a 500).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from harness.engine_pool import API_KEY, reset_to_checkpoint
from harness.fresh_load import save_checkpoint
from harness.trainer import Trainer
from sender_helpers import FakeEngine, engine_checksums, engine_status

from vllm_delta import DeltaSender

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


@pytest.fixture(scope="module")
def root(engine_pool) -> Path:
    return engine_pool.delta_root()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(engine_pool, model_dir, root):
    """The session's shared Llama delta engine, back on its checkpoint (where the trainer starts)."""
    s = engine_pool.shared_llama(model_dir)
    reset_to_checkpoint(s, root, model_dir)
    return s


@pytest.fixture(scope="module")
def base_digests(fresh_loader, model_dir) -> dict[str, str]:
    """The checkpoint's digests, loaded afresh by vLLM alone."""
    return fresh_loader.checksums(model_dir)


@pytest.fixture(scope="module")
def trainer(model_dir) -> Trainer:
    return Trainer(model_dir)


def hdr() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def status(server) -> dict:
    return engine_status(server.url, API_KEY)


def checksums(server) -> dict[str, str]:
    return engine_checksums(server.url, API_KEY)


def push(server, body) -> requests.Response:
    return requests.post(f"{server.url}/update_weights_delta", json=body, headers=hdr(), timeout=120)


def test_trainer_syncs_every_step_over_disk(server, trainer, root):
    """(Seeding from the served checkpoint against a real engine: test_stock_equivalence.py.)"""
    version = status(server)["version"]
    sender = DeltaSender([server.url], "disk", root, api_key=API_KEY, flush_bytes=64 << 10, version=version)
    sender.seed(trainer.weights())
    before = checksums(server)
    for step in range(1, 4):
        trainer.step()
        m = sender.sync(trainer.weights())
        assert m["sender/all_acked"] == 1.0, sender.engines
        assert m["sender/changed_elements"] > 0
        assert status(server)["version"] == version + step and status(server)["healthy"]
        assert m["perf/update_weights_wire_bytes"] > 0 and m["perf/update_weights_engine_apply_time"] > 0
    assert checksums(server) != before
    delivered = [root / f"v{version + step:06d}" for step in range(1, 4)]
    assert not [p for p in delivered if p.exists()], "delivered directories are removed"


def test_one_of_two_engines_fails_then_converges(server, trainer, root):
    """The real engine refuses one version (wrong API key: a real 401); the other engine acks it."""
    version = status(server)["version"]
    healthy = FakeEngine(root, dict(trainer.weights()))
    healthy.version = version
    try:
        sender = DeltaSender(
            [server.url, healthy.url],
            "disk",
            root,
            api_key=API_KEY,
            flush_bytes=64 << 10,
            version=version,
            retries=0,
        )
        sender.seed(trainer.weights())
        trainer.step()
        sender.client.api_key = "wrong-key"
        m = sender.sync(trainer.weights())
        assert m["sender/all_acked"] == 0.0 and sender.engines[server.url].last_status == 401
        assert healthy.version == version + 1 and status(server)["version"] == version
        assert sender.snapshot_version == version
        sender.client.api_key = API_KEY
        trainer.step()
        m = sender.sync(trainer.weights())
        assert m["sender/catchup"] == 1.0 and m["sender/all_acked"] == 1.0  # verified by post-apply hashes
        assert status(server)["version"] == version + 2 == healthy.version
        assert [r["version"] for r in healthy.requests] == [version + 1, version + 2]
        want = dict(trainer.weights())
        assert all(torch.equal(healthy.weights[k], want[k]) for k in want)
        trainer.step()
        m = sender.sync(trainer.weights())
        assert m["sender/catchup"] == 0.0 and m["sender/all_acked"] == 1.0
    finally:
        healthy.close()


def test_duplicate_push_idempotent_and_out_of_order_rejected(server, trainer, root):
    version = status(server)["version"]
    sender = DeltaSender(
        [server.url], "disk", root, api_key=API_KEY, encoding="deltas_zstd", keep=True, version=version
    )
    sender.seed(trainer.weights())
    trainer.step()
    sender.sync(trainer.weights())
    trainer.step()
    sender.sync(trainer.weights())
    digests = checksums(server)
    last = f"v{version + 2:06d}"
    r = push(server, {"path": last, "version": version + 2})
    assert r.status_code == 200 and r.json()["replay"], r.text
    assert checksums(server) == digests
    r = push(server, {"path": f"v{version + 1:06d}", "version": version + 1})  # valid, but behind the engine
    assert r.status_code == 409 and r.json()["error"]["type"] == "LineageError", r.text  # not on this version
    assert checksums(server) == digests and status(server)["version"] == version + 2
    trainer.step()
    m = sender.sync(trainer.weights())  # the sender is unaffected and carries on
    assert m["sender/all_acked"] == 1.0 and status(server)["version"] == version + 3
    for p in root.glob("v*"):
        shutil.rmtree(p)


KILLED_SENDER = """
import sys, torch
from vllm_delta import DeltaSender
from vllm_delta.wire.checkpoint import Checkpoint
url, root, model, key, version = sys.argv[1:6]
s = DeltaSender([url], "disk", root, api_key=key, flush_bytes=16 << 10, throttle_bytes_per_s=64 << 10,
                version=int(version))
s.seed_from_checkpoint(model)
s.request_anchor()
s.sync(Checkpoint.open(model).iter_tensors())
"""


def test_sender_killed_mid_write_leaves_nothing_applicable(server, root, model_dir):
    digests, version = checksums(server), status(server)["version"]
    # With the key: a sender started at a version asks the engines' status (lineage) before it writes.
    start = version + 1000  # a sender of another run, ahead of the engine
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SENDER, server.url, str(root), str(model_dir), API_KEY, str(start)]
    )
    d = root / f"v{start + 1:06d}-anchor"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(d.glob("rank*_flush*.safetensors"))) < 2:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(d.glob("rank*_flush*.safetensors")) and not (d / "manifest.json").exists()
    r = push(server, {"path": d.name, "version": start + 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "IncompleteDeltaError", r.text
    assert r.json()["error"]["file"] == "manifest.json", r.text
    assert checksums(server) == digests and status(server)["version"] == version
    shutil.rmtree(d)


def test_synced_engine_equals_fresh_engine_from_trainer_weights(
    server, trainer, model_dir, root, tmp_path_factory, fresh_loader, base_digests
):
    # The engine resumes at its version; a sender started there resumes the run it is on (lineage), or
    # anchors it. Either way the engine must end on the trainer's weights after one more step.
    sender = DeltaSender(
        [server.url], "disk", root, api_key=API_KEY, flush_bytes=64 << 10, version=status(server)["version"]
    )
    sender.seed(trainer.weights())
    trainer.step()
    m = sender.sync(trainer.weights())
    if m["sender/all_acked"] != 1.0:  # refused by lineage (a restarted or foreign engine): anchored next
        m = sender.sync(trainer.weights())
    assert m["sender/all_acked"] == 1.0, sender.engines
    synced = checksums(server)
    assert synced != base_digests, "the trainer moved away from the checkpoint"
    out = save_checkpoint(dict(trainer.weights()), model_dir, tmp_path_factory.mktemp("trained"))
    # vLLM's own loader on the saved checkpoint, configured as a delta engine (harness/fresh_load).
    assert fresh_loader.checksums(out) == synced
