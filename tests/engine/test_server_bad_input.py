"""`vllm serve --enable-delta-updates` over HTTP: every bad input gets its status, and harms nothing.

One real server (started as a user would, with `--api-key`) serves the whole module. After each
refused request the weights are digest-identical (vLLM's `/weight_checker`), the status route
says healthy, and a prompt still completes. The good updates run last, since they move the weights.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable

import pytest
import requests
import torch
import zstandard

from vllm_delta.wire.additive import combine, partial_sum, tensor_sum, to_hex
from vllm_delta.wire import (CorruptDeltaError, DtypeMismatchError, Manifest, ParamChange, ParamEntry,
                             ShapeMismatchError, UnknownParamError, bytes_digest, encode_flush, file_entry,
                             flush_name, get_encoding, write_manifest)

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

F = flush_name(0, 0)
Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def baseline(delta_server, child_environ) -> dict[str, str]:
    """The served weights before any update, and proof the server came up with the flag's effects."""
    status = delta_server.status()
    assert status["healthy"] and status["version"] == 0, status
    assert any(env.get("VLLM_DELTA_UPDATES") == "1" for env in child_environ(delta_server.server))
    return delta_server.checksums()


def resign(d, data: bytes) -> None:
    """Replace the flush file and re-sign the manifest, as an attacker controlling both could."""
    (d / F).write_bytes(data)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    (d / "manifest.json").write_text(json.dumps(m))


def crafted(deltas, label: str, positions: list[int], name: str = NORM, shape=(128,)):
    """A delta whose flush skips the writer's checks (so positions can be out of range or repeated)."""
    pos = torch.tensor(positions, dtype=torch.int64)
    vals = torch.ones(len(positions), dtype=torch.bfloat16)
    flush = encode_flush([ParamChange(name, shape, pos, vals, vals)], encoding=get_encoding("indices"),
                         version=1, base_version=0)
    d = deltas.fresh_dir(label)
    d.mkdir()
    (d / F).write_bytes(flush.data)
    write_manifest(d, Manifest(version=1, base_version=0, encoding="indices", files=[file_entry(F, flush)],
                               params=[ParamEntry(name=name, dtype="bfloat16", shape=list(shape),
                                                  changed=len(positions), files=[F])]))
    return d


def good(deltas, label: str, encoding: str = "ulp_zstd"):
    return deltas.write(label, deltas.perturbed([Q, DOWN], seed=7), encoding=encoding)


def truncated(deltas):
    d = good(deltas, "truncated")
    (d / F).write_bytes((d / F).read_bytes()[:-10])
    return d


def flipped_byte(deltas):
    d = good(deltas, "flipped")
    data = bytearray((d / F).read_bytes())
    data[len(data) // 2] ^= 0x40
    (d / F).write_bytes(bytes(data))
    return d


def wrong_hash(deltas):
    d = good(deltas, "wrong-hash")
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0]["hash"] = "0" * len(m["files"][0]["hash"])
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def header_bomb(deltas):
    d = good(deltas, "header-bomb")
    resign(d, struct.pack("<Q", 1 << 40) + (d / F).read_bytes()[8:])
    return d


def zstd_bomb(deltas):
    d = good(deltas, "zstd-bomb", encoding="deltas_zstd")
    resign(d, zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"\0" * (64 << 20)))
    return d


def missing_file(deltas):
    d = good(deltas, "missing-file")
    (d / F).unlink()
    return d


def unfinished(deltas):
    d = good(deltas, "unfinished")
    (d / "manifest.json").unlink()
    return d


def garbage_manifest(deltas):
    d = good(deltas, "garbage-manifest")
    (d / "manifest.json").write_text("{not json")
    return d


CORRUPT: dict[str, Callable] = {
    "truncated": truncated,
    "flipped-byte": flipped_byte,
    "wrong-hash": wrong_hash,
    "header-bomb": header_bomb,
    "zstd-bomb": zstd_bomb,
    "out-of-range": lambda deltas: crafted(deltas, "out-of-range", [2, 128]),
    "duplicates": lambda deltas: crafted(deltas, "duplicates", [3, 3, 4]),
    "missing-file": missing_file,
    "unfinished": unfinished,
    "garbage-manifest": garbage_manifest,
}

CORRUPT_TYPES = {cls.__name__ for cls in (CorruptDeltaError, *CorruptDeltaError.__subclasses__())}

MISFIT: dict[str, tuple[type, Callable]] = {
    "unknown-param": (UnknownParamError, lambda deltas: deltas.raw(
        "unknown", "model.layers.9.mlp.up_proj.weight", (256, 128), [0, 5], torch.ones(2, dtype=torch.bfloat16))),
    "shape": (ShapeMismatchError, lambda deltas: deltas.raw(
        "shape", NORM, (64,), [0, 5], torch.ones(2, dtype=torch.bfloat16))),
    "dtype": (DtypeMismatchError, lambda deltas: deltas.raw(
        "dtype", NORM, (128,), [0, 5], torch.ones(2, dtype=torch.float32))),
}


def test_placement_is_learned_at_startup(delta_server, baseline):
    """Before any update the status reports the probe (ready, its cost, nothing falling back) and the
    coverage check across ranks."""
    deadline = time.monotonic() + 120
    while (not (placement := delta_server.status()["placement"])["ready"] or placement["coverage"] is None) \
            and time.monotonic() < deadline:
        time.sleep(1)
    assert placement["ready"] and placement["probe_s"] > 0 and placement["fallback"] == [], placement
    # The cross-rank coverage check ran at startup too: every checkpoint element is held.
    assert placement["coverage"]["ok"] and placement["coverage"]["errors"] == {}, placement
    assert placement["probe_peak_bytes"] is not None and isinstance(placement["transformed"], list), placement
    assert delta_server.status()["last"] is None  # no update has run


def test_api_key_is_required(delta_server, deltas, baseline):
    body = {"path": good(deltas, "auth").name, "version": 1, "base_version": 0}
    for key, headers in ((None, None), ("wrong-key", None), (None, {"Authorization": "Basic delta-test-key"})):
        resp = delta_server.update(body, key=key, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "Unauthorized"
    assert requests.get(f"{delta_server.url}/delta_updates/status", timeout=30).status_code == 401
    delta_server.assert_unharmed(baseline, version=0)


def test_paths_outside_the_root_are_403(delta_server, deltas, tmp_path, baseline):
    outside = deltas.write("outside", deltas.perturbed([Q], seed=1))
    escaped = tmp_path / "escaped"
    outside.rename(escaped)
    link_dir = deltas.root / "link-to-outside"
    link_dir.symlink_to(escaped, target_is_directory=True)
    linked_file = good(deltas, "linked-file")
    (linked_file / F).unlink()
    (linked_file / F).symlink_to(escaped / F)
    for path in (str(escaped), "../escaped", f"{link_dir.name}/../../escaped", link_dir.name, "/etc",
                 linked_file.name):
        resp = delta_server.update({"path": path, "version": 1, "base_version": 0})
        assert resp.status_code == 403, (path, resp.text)
        assert "outside" in resp.json()["error"]["message"]
        delta_server.assert_unharmed(baseline, version=0)


@pytest.mark.parametrize("raw", [
    b"{not json", b"", b"[]", b'"path"',
    b'{"version": 1}',                                         # no path
    b'{"path": "x"}',                                          # no version
    b'{"path": "x", "version": "1"}',                          # version as a string
    b'{"path": "x", "version": 1.5}',
    b'{"path": "x", "version": true}',
    b'{"path": "x", "version": -1}',
    b'{"path": 7, "version": 1}',
    b'{"path": "x", "version": 1, "base_version": "0"}',
    b'{"path": "x", "version": 1, "files": "a.safetensors"}',
    b'{"path": "x", "version": 1, "files": ["../a.safetensors"]}',
    b'{"path": "x", "version": 1, "extra": 1}',
    b'{"path": "does-not-exist", "version": 1}',
], ids=lambda raw: raw.decode()[:40] or "empty")
def test_malformed_requests_are_400(delta_server, baseline, raw):
    resp = delta_server.update(raw=raw)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]
    delta_server.assert_unharmed(baseline, version=0)


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_deltas_are_400(delta_server, deltas, baseline, case):
    d = CORRUPT[case](deltas)
    resp = delta_server.update({"path": d.name, "version": 1, "base_version": 0})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] in CORRUPT_TYPES and error["message"], error
    delta_server.assert_unharmed(baseline, version=0)


def test_wrong_base_version_is_409(delta_server, deltas, baseline):
    d = deltas.write("base5", deltas.perturbed([Q], seed=3), version=6, base_version=5)
    resp = delta_server.update({"path": d.name, "version": 6, "base_version": 5})
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["type"] == "VersionError"
    delta_server.assert_unharmed(baseline, version=0)


@pytest.mark.parametrize("case", sorted(MISFIT))
def test_deltas_that_do_not_fit_the_model_are_422(delta_server, deltas, baseline, case):
    error_type, build = MISFIT[case]
    resp = delta_server.update({"path": build(deltas).name, "version": 1, "base_version": 0})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["type"] == error_type.__name__ and error["param"], error
    delta_server.assert_unharmed(baseline, version=0)


def test_collective_path_is_off_without_its_flag(delta_server, deltas, baseline):
    """No `--delta-updates-collective-trainers`: the workers never join a group, nor wait for one."""
    init = {"master_addr": "127.0.0.1", "master_port": 29555, "world_size": 2, "timeout_s": 1}
    resp = requests.post(f"{delta_server.url}/delta_updates/collective/init", json=init,
                         headers=delta_server.headers(), timeout=120)
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "CollectiveDisabled", resp.text
    manifest = json.loads((good(deltas, "collective-off") / "manifest.json").read_text())
    resp = delta_server.update({"transport": "collective", "manifest": manifest, "version": 1, "base_version": 0})
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "CollectiveDisabled", resp.text
    delta_server.assert_unharmed(baseline, version=0)


def test_refusals_are_counted(delta_server, baseline):
    text = requests.get(f"{delta_server.url}/metrics", timeout=30).text
    for status in (400, 401, 403, 409, 422):
        assert f'vllm_delta:update_failures_total{{status="{status}"}}' in text, status


def with_digests(d, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], **wrong: str) -> None:
    """Add the additive digests (from the full tensors) to a delta's manifest; `wrong` breaks one."""
    m = json.loads((d / "manifest.json").read_text())
    for p in m["params"]:
        a, b = old[p["name"]].reshape(-1), new[p["name"]].reshape(-1)
        pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
        p.update(pre_digest=to_hex(partial_sum(pos, a[pos])), post_digest=to_hex(partial_sum(pos, b[pos])),
                 digest=to_hex(tensor_sum(new[p["name"]])))
        for field, name in wrong.items():
            if name == p["name"]:
                p[field] = combine(p[field], "0" * 31 + "1")
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("field", ["pre_digest", "post_digest"])
def test_digest_mismatches_are_400_before_any_write(delta_server, deltas, baseline, field):
    new = deltas.perturbed([Q, DOWN], seed=21)
    d = deltas.write(f"bad-{field}", new, version=1, base_version=0)
    with_digests(d, deltas.base, new, **{field: DOWN})
    resp = delta_server.update({"path": d.name, "version": 1, "base_version": 0})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "IntegrityError" and error["param"] == DOWN and field[:-7] in error["message"], error
    delta_server.assert_unharmed(baseline, version=0)


# The good updates: these move the weights, so they run after every refusal above.

def moved(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """Params whose digest changed, without vLLM's `dp0:pp0:...:` rank prefix."""
    return {name.rsplit(":", 1)[-1] for name in before if after[name] != before[name]}


def test_apply_returns_metrics_and_changes_only_its_params(delta_server, deltas, baseline):
    d = deltas.write("v1", deltas.perturbed([Q, DOWN], seed=11), version=1, base_version=0)
    resp = delta_server.update({"path": str(d), "version": 1, "base_version": 0})
    assert resp.status_code == 200, resp.text
    result = resp.json()
    manifest = json.loads((d / "manifest.json").read_text())
    assert result["version"] == 1 and result["replay"] is False
    assert result["changed"] == sum(p["changed"] for p in manifest["params"]) > 0
    assert result["bytes_read"] >= sum(f["bytes"] for f in manifest["files"])
    assert min(result["decode_s"], result["apply_s"]) >= 0 and result["pause_s"] > 0
    assert len(result["ranks"]) == 1 and result["fallback"] == []
    assert moved(baseline, delta_server.checksums()) == {"model.layers.0.self_attn.qkv_proj.weight", DOWN}
    status = delta_server.status()
    assert status["healthy"] and status["version"] == 1 and status["last"]["version"] == 1
    assert delta_server.complete()["text"]


def test_non_idempotent_replays_are_409(delta_server, deltas):
    before = delta_server.checksums()
    applied = next(p for p in deltas.root.iterdir() if p.name.endswith("-v1"))
    resp = delta_server.update({"path": applied.name, "version": 1})  # base-relative: applies once
    assert resp.status_code == 409, resp.text
    delta_server.assert_unharmed(before, version=1)
    other = deltas.write("v1-other", deltas.perturbed([NORM], seed=12), version=1, base_version=0)
    resp = delta_server.update({"path": other.name, "version": 1, "base_version": 0})
    assert resp.status_code == 409, resp.text
    delta_server.assert_unharmed(before, version=1)


def test_idempotent_replay_is_200_and_changes_nothing(delta_server, deltas):
    before = delta_server.checksums()
    d = deltas.write("v2", deltas.perturbed([NORM], seed=13), version=2, base_version=1, encoding="deltas_zstd")
    resp = delta_server.update({"path": d.name, "version": 2, "base_version": 1})
    assert resp.status_code == 200, resp.text
    after = delta_server.checksums()
    assert moved(before, after) == {NORM}
    resp = delta_server.update({"path": d.name, "version": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["replay"] is True
    delta_server.assert_unharmed(after, version=2)


def test_empty_delta_bumps_the_version_without_pausing(delta_server, deltas):
    before = delta_server.checksums()
    d = deltas.write("v3-empty", {}, version=3, base_version=2)
    resp = delta_server.update({"path": d.name, "version": 3, "base_version": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["changed"] == 0 and resp.json()["pause_s"] == 0
    delta_server.assert_unharmed(before, version=3)


def test_metrics_are_on_vllm_metrics(delta_server):
    text = requests.get(f"{delta_server.url}/metrics", timeout=30).text
    for series in ("vllm_delta:apply_seconds_count", "vllm_delta:decode_seconds_count",
                   "vllm_delta:pause_seconds_count", "vllm_delta:bytes_read_count",
                   "vllm_delta:changed_elements_count"):
        assert f"{series} 4.0" in text, series
    assert "vllm_delta:weights_version 3.0" in text
    assert "vllm:" in text, "vLLM's own series are still there"


def test_digests_are_checked_and_a_full_verify_agrees(delta_server, deltas):
    """Last, after the metrics count: v1 and v2 above moved Q, DOWN (seed 11) and NORM (seed 13);
    v4 moves Q and DOWN again."""
    current = {**deltas.perturbed([Q, DOWN], seed=11), **deltas.perturbed([NORM], seed=13)}
    new = {n: t.clone() for n, t in current.items() if n != NORM}
    for t in new.values():
        t.view(-1).view(torch.int16)[::7] += 1
    d = deltas.write("v4-digests", new, version=4, base_version=3, old=current)
    with_digests(d, current, new)
    resp = delta_server.update({"path": d.name, "version": 4, "base_version": 3})
    assert resp.status_code == 200, resp.text
    resp = requests.post(f"{delta_server.url}/delta_updates/verify", headers=delta_server.headers(), timeout=120)
    assert resp.status_code == 200, resp.text
    report = resp.json()
    assert report["ok"] and report["digests_checked"] == 2 and report["hashes_checked"] == 3, report
    assert delta_server.status()["fault"] is None
