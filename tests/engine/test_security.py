"""Locked-down delta routes (docs/security.md): who may start a server, what a request may carry, and
what the workers will open.

Startup refusals are in test_serve_parser.py (in-process, no engine). The route cases share one
server with a small body cap and a collective allowlist: the first of the session's engine pair
(harness/engine_pair.py, shared with other modules), put back on its checkpoint first. Each bad input
uses an otherwise valid delta directory at the engine's next version, asserts the error type and the
field it names, and checks the engine was left as it was (weights digest-identical, same version, same
greedy tokens and logprobs as before the cases).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from harness.engine_pair import MAX_BODY

from vllm_delta.wire import flush_name

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

F = flush_name(0, 0)
Q = "model.layers.0.self_attn.q_proj.weight"


# ---- one server: body cap, collective allowlist, safe file opening ------------------------------


@pytest.fixture(scope="module")
def delta_root(engine_pair) -> Path:
    """The pair's root: the deltas below are written where the guarded engine reads."""
    return engine_pair.root


@pytest.fixture(scope="module")
def guarded(paired_server):
    """Body cap MAX_BODY; collective trainers 10.9.8.0/24 and trainer.example (and the pair's
    127.0.0.1)."""
    return paired_server


@dataclass(frozen=True)
class Before:
    """The engine before any case: its version (each case's delta is at the next) and what it served
    (a `Baseline`)."""

    version: int
    served: object

    def body(self, delta: Path) -> dict:
        return {"path": delta.name, "version": self.version + 1, "base_version": self.version}


@pytest.fixture(scope="module")
def baseline(guarded) -> Before:
    """Version, digests and greedy tokens + logprobs before any case (no case here may commit an
    update)."""
    status = guarded.status()
    assert status["healthy"], status
    return Before(status["version"], guarded.baseline())


def assert_unchanged(server, baseline: Before) -> None:
    server.assert_unharmed(baseline.served, version=baseline.version)


def refused(resp: requests.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    return error


def good(deltas, label: str, baseline: Before) -> Path:
    """A valid delta of one tensor from the checkpoint, at the engine's next version."""
    v = baseline.version
    return deltas.write(label, deltas.perturbed([Q], seed=5), version=v + 1, base_version=v)


def test_body_over_the_cap_is_refused(guarded, deltas, baseline):
    body = baseline.body(good(deltas, "big-body", baseline))
    padded = json.dumps(body).encode()[:-1] + b" " * MAX_BODY + b"}"  # valid JSON, one cap too long
    error = refused(guarded.update(raw=padded), 413, "RequestTooLarge")
    assert str(MAX_BODY) in error["message"]

    def chunked():  # no Content-Length: the cap holds while the body streams in
        yield padded[:1000]
        yield padded[1000:]

    resp = requests.post(
        f"{guarded.url}/update_weights_delta",
        data=chunked(),
        timeout=60,
        headers={"Content-Type": "application/json", **guarded.headers()},
    )
    refused(resp, 413, "RequestTooLarge")
    assert_unchanged(guarded, baseline)


def collective_init(server, **overrides) -> requests.Response:
    body = {
        "master_addr": "10.9.8.7",
        "master_port": 29555,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 1,
        **overrides,
    }
    return requests.post(
        f"{server.url}/delta_updates/collective/init", json=body, headers=server.headers(), timeout=120
    )


# An id without "::" for the IPv4-mapped address: xdist's `loadscope` cuts a node id at its last "::" to
# find the module, so that case was a scope of its own, sent to the other worker to start this engine again.
@pytest.mark.parametrize(
    "addr",
    ["10.1.2.3", pytest.param("::ffff:10.1.2.3", id="ipv4-mapped"), "trainer.example.evil", "attacker"],
)
def test_collective_init_refuses_trainers_outside_the_allowlist(guarded, baseline, addr):
    error = refused(collective_init(guarded, master_addr=addr), 403, "TrainerNotAllowed")
    assert addr in error["message"]
    assert_unchanged(guarded, baseline)


def test_collective_timeout_is_capped(guarded, baseline):
    error = refused(collective_init(guarded, timeout_s=3600), 400, "InvalidRequest")
    assert error["message"].startswith("timeout_s: "), error
    assert_unchanged(guarded, baseline)


def test_fifo_manifest_is_refused_without_hanging(guarded, deltas, baseline):
    d = good(deltas, "fifo-manifest", baseline)
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")
    resp = guarded.update(baseline.body(d))  # 120 s client timeout
    error = refused(resp, 400, "FormatError")
    assert error["file"] == "manifest.json" and "regular file" in error["message"]
    assert_unchanged(guarded, baseline)


def test_fifo_flush_file_is_refused(guarded, deltas, baseline):
    d = good(deltas, "fifo-flush", baseline)
    (d / F).unlink()
    os.mkfifo(d / F)
    error = refused(guarded.update(baseline.body(d)), 400, "FormatError")
    assert error["file"] == F and "regular file" in error["message"]
    assert_unchanged(guarded, baseline)


def test_symlinked_flush_file_is_not_followed_even_inside_the_root(guarded, deltas, baseline):
    """A link the API server's path check accepts (it stays under the root) is still never opened."""
    d = good(deltas, "symlink-flush", baseline)
    target = deltas.root / "elsewhere.safetensors"
    shutil.move(d / F, target)
    (d / F).symlink_to(target)
    error = refused(guarded.update(baseline.body(d)), 400, "FormatError")
    assert error["file"] == F and "symlink" in error["message"]
    assert_unchanged(guarded, baseline)


# ---- hostile files (issue 33): each malformed input a 400 naming it, the engine unchanged ---------


def _edit_manifest(d, edit) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))


def test_a_manifest_shape_that_is_a_number_is_a_400(guarded, deltas, baseline):
    d = good(deltas, "shape-number", baseline)
    _edit_manifest(d, lambda m: m["params"][0].__setitem__("shape", 7))
    refused(guarded.update(baseline.body(d)), 400, "FormatError")
    assert_unchanged(guarded, baseline)


def test_deeply_nested_flush_params_are_a_400(guarded, deltas, baseline):
    from vllm_delta.wire import Limits, bytes_digest
    from vllm_delta.wire.container import pack, unpack

    d = good(deltas, "deep-params", baseline)
    tensors, meta = unpack((d / F).read_bytes(), file=F, limits=Limits())
    data = pack(
        {k: bytes(t.data) for k, t in tensors.items()}, {**meta, "params": "[" * 100_000 + "]" * 100_000}
    )
    (d / F).write_bytes(data)
    _edit_manifest(d, lambda m: m["files"][0].update(bytes=len(data), hash=bytes_digest(data)))
    error = refused(guarded.update(baseline.body(d)), 400, "FormatError")
    assert error["file"] == F and "not JSON" in error["message"]
    assert_unchanged(guarded, baseline)


def test_a_seed_format_delta_is_refused_unless_allowed(guarded, deltas, baseline):
    """No --delta-updates-allow-seed-format on this server: a directory with no manifest is refused."""
    d = good(deltas, "seed-not-allowed", baseline)
    (d / "manifest.json").unlink()
    error = refused(guarded.update(baseline.body(d)), 400, "IncompleteDeltaError")
    assert "allow-seed-format" in error["message"]
    assert_unchanged(guarded, baseline)
