"""`vllm serve --enable-delta-updates` over HTTP: every bad input gets its status, and harms nothing.

One real server (started as a user would, with `--api-key`; the session's shared Llama engine, put
back on its checkpoint when the module starts) serves the whole module. Every bad
request is otherwise valid: it names an existing delta directory written against the weights the
server holds now, at the next version, so only the one defect can be what is refused. Each asserts
the error type and the field (or file/param) it names, then that the server is unharmed: weights
digest-identical (vLLM's `/weight_checker`), status healthy at the same version, and the same greedy
tokens and logprobs as a baseline taken before the case. `served` tracks the version and weights
the server holds, so the good updates can run in any order among the refusals.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import torch
import zstandard
from harness.engine_pool import API_KEY

from vllm_delta.wire import (
    BoundsError,
    DtypeMismatchError,
    FormatError,
    IncompleteDeltaError,
    IntegrityError,
    LimitError,
    Manifest,
    ParamChange,
    ParamEntry,
    ShapeMismatchError,
    UnknownParamError,
    bytes_digest,
    encode_flush,
    file_entry,
    flush_name,
    get_encoding,
    read_delta,
    write_manifest,
)
from vllm_delta.wire.additive import combine, partial_sum, tensor_sum, to_hex

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

F = flush_name(0, 0)
MANIFEST = "manifest.json"
Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"
UNKNOWN = "model.layers.9.mlp.up_proj.weight"


@dataclass
class Served:
    """What the module's server holds now: updates that commit advance it, refusals must not."""

    version: int
    weights: dict[str, torch.Tensor]
    before: object  # conftest.Baseline: digests and greedy output at `version`
    hashed: set[str] = field(default_factory=set)  # params an applied update stated a post_hash for
    digested: set[str] = field(default_factory=set)  # ... and a whole-tensor additive digest

    def next(
        self,
        deltas,
        label: str,
        names: list[str],
        seed: int,
        encoding: str = "ulp_zstd",
    ) -> tuple[Path, dict[str, torch.Tensor]]:
        """A valid delta from the served weights to new ones (5% of `names`' elements one ULP up),
        at the next version on this one."""
        gen = torch.Generator().manual_seed(seed)
        new = {}
        for name in names:
            t = self.weights[name].clone()
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.shape, generator=gen) < 0.05] += 1
            new[name] = t
        d = deltas.write(
            label,
            new,
            version=self.version + 1,
            base_version=self.version,
            encoding=encoding,
            old=self.weights,
        )
        return d, new

    def body(self, d: Path) -> dict:
        return {"path": d.name, "version": self.version + 1, "base_version": self.version}

    def committed(self, server, new: dict[str, torch.Tensor], digested: tuple[str, ...] = ()) -> None:
        self.version += 1
        self.weights = {**self.weights, **new}
        self.hashed |= set(new)
        self.digested |= set(digested)
        self.before = server.baseline()


@pytest.fixture(scope="module")
def served(delta_server, deltas, child_environ) -> Served:
    """The server before any update, and proof it came up with the flag's effects."""
    status = delta_server.status()
    assert status["healthy"], status  # on its checkpoint (delta_server), at whatever version it reached
    assert any(env.get("VLLM_DELTA_UPDATES") == "1" for env in child_environ(delta_server.server))
    return Served(status["version"], dict(deltas.base), delta_server.baseline())


def refused(resp: requests.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_ and error["message"], error
    return error


def resign(d, data: bytes) -> None:
    """Replace the flush file and re-sign the manifest, as an attacker controlling both could."""
    (d / F).write_bytes(data)
    m = json.loads((d / MANIFEST).read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    (d / MANIFEST).write_text(json.dumps(m))


def crafted(deltas, served: Served, label: str, positions: list[int], name: str = NORM, shape=(128,)):
    """A delta whose flush skips the writer's checks (so positions can be out of range or repeated)."""
    pos = torch.tensor(positions, dtype=torch.int64)
    vals = torch.ones(len(positions), dtype=torch.bfloat16)
    v, base = served.version + 1, served.version
    flush = encode_flush(
        [ParamChange(name, shape, pos, vals, vals)],
        encoding=get_encoding("indices"),
        version=v,
        base_version=base,
    )
    d = deltas.fresh_dir(label)
    d.mkdir()
    (d / F).write_bytes(flush.data)
    write_manifest(
        d,
        Manifest(
            version=v,
            base_version=base,
            encoding="indices",
            files=[file_entry(F, flush)],
            params=[
                ParamEntry(name=name, dtype="bfloat16", shape=list(shape), changed=len(positions), files=[F])
            ],
        ),
    )
    return d


def good(deltas, served: Served, label: str, encoding: str = "ulp_zstd") -> Path:
    return served.next(deltas, label, [Q, DOWN], seed=7, encoding=encoding)[0]


def truncated(deltas, served):
    d = good(deltas, served, "truncated")
    (d / F).write_bytes((d / F).read_bytes()[:-10])
    return d


def flipped_byte(deltas, served):
    d = good(deltas, served, "flipped")
    data = bytearray((d / F).read_bytes())
    data[len(data) // 2] ^= 0x40
    (d / F).write_bytes(bytes(data))
    return d


def wrong_hash(deltas, served):
    d = good(deltas, served, "wrong-hash")
    m = json.loads((d / MANIFEST).read_text())
    m["files"][0]["hash"] = "0" * len(m["files"][0]["hash"])
    (d / MANIFEST).write_text(json.dumps(m))
    return d


def header_bomb(deltas, served):
    d = good(deltas, served, "header-bomb")
    resign(d, struct.pack("<Q", 1 << 40) + (d / F).read_bytes()[8:])
    return d


def zstd_bomb(deltas, served):
    d = good(deltas, served, "zstd-bomb", encoding="deltas_zstd")
    resign(d, zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"\0" * (64 << 20)))
    return d


def missing_file(deltas, served):
    d = good(deltas, served, "missing-file")
    (d / F).unlink()
    return d


def unfinished(deltas, served):
    d = good(deltas, served, "unfinished")
    (d / MANIFEST).unlink()
    return d


def garbage_manifest(deltas, served):
    d = good(deltas, served, "garbage-manifest")
    (d / MANIFEST).write_text("{not json")
    return d


# case -> (build, error type, the file it names, the param it names)
CORRUPT: dict[str, tuple[Callable, type, str, str | None]] = {
    "truncated": (truncated, IntegrityError, F, None),
    "flipped-byte": (flipped_byte, IntegrityError, F, None),
    "wrong-hash": (wrong_hash, IntegrityError, F, None),
    "header-bomb": (header_bomb, LimitError, F, None),
    "zstd-bomb": (zstd_bomb, LimitError, F, None),
    "out-of-range": (
        lambda deltas, served: crafted(deltas, served, "out-of-range", [2, 128]),
        BoundsError,
        F,
        NORM,
    ),
    "duplicates": (
        lambda deltas, served: crafted(deltas, served, "duplicates", [3, 3, 4]),
        BoundsError,
        F,
        NORM,
    ),
    "missing-file": (missing_file, IncompleteDeltaError, F, None),
    "unfinished": (unfinished, IncompleteDeltaError, MANIFEST, None),
    "garbage-manifest": (garbage_manifest, FormatError, MANIFEST, None),
}

# case -> (error type, the param it names, build)
MISFIT: dict[str, tuple[type, str, Callable]] = {
    "unknown-param": (
        UnknownParamError,
        UNKNOWN,
        lambda deltas, served: deltas.raw(
            "unknown",
            UNKNOWN,
            (256, 128),
            [0, 5],
            torch.ones(2, dtype=torch.bfloat16),
            version=served.version + 1,
            base_version=served.version,
        ),
    ),
    "shape": (
        ShapeMismatchError,
        NORM,
        lambda deltas, served: deltas.raw(
            "shape",
            NORM,
            (64,),
            [0, 5],
            torch.ones(2, dtype=torch.bfloat16),
            version=served.version + 1,
            base_version=served.version,
        ),
    ),
    "dtype": (
        DtypeMismatchError,
        NORM,
        lambda deltas, served: deltas.raw(
            "dtype",
            NORM,
            (128,),
            [0, 5],
            torch.ones(2, dtype=torch.float32),
            version=served.version + 1,
            base_version=served.version,
        ),
    ),
}


def test_placement_is_learned_at_startup(delta_server, served):
    """The status reports the probe learned at startup (ready, its cost, nothing falling back) and the
    coverage check across ranks."""
    deadline = time.monotonic() + 120
    while (
        not (placement := delta_server.status()["placement"])["ready"] or placement["coverage"] is None
    ) and time.monotonic() < deadline:
        time.sleep(1)
    assert placement["ready"] and isinstance(placement["probe_s"], float) and placement["fallback"] == [], (
        placement
    )
    # The cross-rank coverage check ran at startup too: every checkpoint element is held.
    assert placement["coverage"]["ok"] and placement["coverage"]["errors"] == {}, placement
    assert placement["probe_peak_bytes"] is not None and isinstance(placement["transformed"], list), placement


def test_api_key_is_required(delta_server, deltas, served):
    body = served.body(good(deltas, served, "auth"))
    for key, headers in ((None, None), ("wrong-key", None), (None, {"Authorization": f"Basic {API_KEY}"})):
        refused(delta_server.update(body, key=key, headers=headers), 401, "Unauthorized")
    assert requests.get(f"{delta_server.url}/delta_updates/status", timeout=30).status_code == 401
    delta_server.assert_unharmed(served.before, version=served.version)


def test_paths_outside_the_root_are_403(delta_server, deltas, tmp_path, served):
    outside, _ = served.next(deltas, "outside", [Q], seed=1)
    escaped = tmp_path / "escaped"
    outside.rename(escaped)
    link_dir = deltas.root / f"link-to-outside-{served.version}"
    link_dir.symlink_to(escaped, target_is_directory=True)
    linked_file = good(deltas, served, "linked-file")
    (linked_file / F).unlink()
    (linked_file / F).symlink_to(escaped / F)
    for path in (
        str(escaped),
        "../escaped",
        f"{link_dir.name}/../../escaped",
        link_dir.name,
        "/etc",
        linked_file.name,
    ):
        resp = delta_server.update({**served.body(escaped), "path": path})
        error = refused(resp, 403, "PathOutsideRoot")
        assert "outside" in error["message"], (path, error)
        delta_server.assert_unharmed(served.before, version=served.version)


# raw body (PATH: an existing valid delta directory, VER / BASE: the next and the served version)
# -> the field the 400 names, and a word its message must contain
MALFORMED: dict[bytes, tuple[str, str]] = {
    b"{not json": ("body", "JSON"),
    b"": ("body", "JSON"),
    b"[]": ("body", "object"),
    b'"PATH"': ("body", "object"),
    b'{"version": VER, "base_version": BASE}': ("body", "`path`"),
    b'{"path": "PATH", "base_version": BASE}': ("version", "required"),
    b'{"path": "PATH", "version": "VER", "base_version": BASE}': ("version", "integer"),
    b'{"path": "PATH", "version": VER.5, "base_version": BASE}': ("version", "integer"),
    b'{"path": "PATH", "version": true, "base_version": BASE}': ("version", "integer"),
    b'{"path": "PATH", "version": -1, "base_version": BASE}': ("version", "greater than or equal to 0"),
    b'{"path": 7, "version": VER, "base_version": BASE}': ("path", "string"),
    b'{"path": "", "version": VER, "base_version": BASE}': ("path", "at least 1"),
    b'{"path": "PATH", "version": VER, "base_version": "BASE"}': ("base_version", "integer"),
    b'{"path": "PATH", "version": VER, "base_version": BASE, "files": "F"}': ("files", "array"),
    b'{"path": "PATH", "version": VER, "base_version": BASE, "files": ["../F"]}': (
        "files",
        "plain file name",
    ),
    b'{"path": "PATH", "version": VER, "base_version": BASE, "extra": 1}': ("extra", "not permitted"),
    b'{"path": "PATH", "version": VER, "base_version": BASE, "transport": "x"}': ("transport", "disk"),
    b'{"path": "PATH", "version": VER, "base_version": BASE, "manifest": {}}': ("body", "`manifest`"),
}


@pytest.mark.parametrize("raw", MALFORMED, ids=lambda raw: raw.decode() or "empty")
def test_malformed_requests_are_400_naming_the_field(delta_server, deltas, served, raw):
    d = good(deltas, served, "malformed")
    read_delta(d, current_version=served.version)  # the directory itself is valid: it decodes in full
    body = (
        raw.replace(b"PATH", d.name.encode())
        .replace(b"VER", str(served.version + 1).encode())
        .replace(b"BASE", str(served.version).encode())
        .replace(b'"F"', json.dumps(F).encode())
        .replace(b"../F", f"../{F}".encode())
    )
    field_, word = MALFORMED[raw]
    error = refused(delta_server.update(raw=body), 400, "InvalidRequest")
    assert error["message"].startswith(f"{field_}: ") and word in error["message"], error
    delta_server.assert_unharmed(served.before, version=served.version)


def test_a_path_that_is_not_a_delta_directory_is_400(delta_server, deltas, served):
    d = good(deltas, served, "not-a-dir")
    for path in ("does-not-exist", f"{d.name}/{MANIFEST}"):
        error = refused(delta_server.update({**served.body(d), "path": path}), 400, "NotADeltaDirectory")
        assert repr(path) in error["message"], error
    delta_server.assert_unharmed(served.before, version=served.version)


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_deltas_are_400(delta_server, deltas, served, case):
    build, error_type, file, param = CORRUPT[case]
    error = refused(delta_server.update(served.body(build(deltas, served))), 400, error_type.__name__)
    assert (error["file"], error["param"]) == (file, param), error
    delta_server.assert_unharmed(served.before, version=served.version)


def test_wrong_base_version_is_409(delta_server, deltas, served):
    v = served.version
    new = served.next(deltas, "base-ahead", [Q], seed=3)[1]
    d = deltas.write("base-ahead-5", new, version=v + 6, base_version=v + 5, old=served.weights)
    error = refused(
        delta_server.update({"path": d.name, "version": v + 6, "base_version": v + 5}), 409, "VersionError"
    )
    assert str(v + 5) in error["message"], error
    delta_server.assert_unharmed(served.before, version=v)


@pytest.mark.parametrize("case", sorted(MISFIT))
def test_deltas_that_do_not_fit_the_model_are_422(delta_server, deltas, served, case):
    error_type, param, build = MISFIT[case]
    error = refused(delta_server.update(served.body(build(deltas, served))), 422, error_type.__name__)
    assert error["param"] == param, error
    delta_server.assert_unharmed(served.before, version=served.version)


def test_collective_path_is_off_without_its_flag(delta_server, deltas, served):
    """No `--delta-updates-collective-trainers`: the workers never join a group, nor wait for one."""
    init = {"master_addr": "127.0.0.1", "master_port": 29555, "world_size": 2, "timeout_s": 1}
    resp = requests.post(
        f"{delta_server.url}/delta_updates/collective/init",
        json=init,
        headers=delta_server.headers(),
        timeout=120,
    )
    refused(resp, 403, "CollectiveDisabled")
    d = good(deltas, served, "collective-off")
    manifest = json.loads((d / MANIFEST).read_text())
    body = {**served.body(d), "transport": "collective", "manifest": manifest}
    del body["path"]
    refused(delta_server.update(body), 403, "CollectiveDisabled")
    delta_server.assert_unharmed(served.before, version=served.version)


def metric(text: str, series: str) -> float:
    """The value of one series in Prometheus text (0 if absent)."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def metrics(server) -> str:
    return requests.get(f"{server.url}/metrics", timeout=30).text


def test_each_refusal_is_counted_once_under_its_status(delta_server, deltas, served):
    series = {s: f'vllm_delta:update_failures_total{{status="{s}"}}' for s in (400, 401, 403, 409, 422)}
    before = {s: metric(metrics(delta_server), name) for s, name in series.items()}
    d = good(deltas, served, "counted")
    v = served.version
    refused(delta_server.update({**served.body(d), "version": "x"}), 400, "InvalidRequest")
    refused(delta_server.update(served.body(d), key="wrong-key"), 401, "Unauthorized")
    refused(delta_server.update({**served.body(d), "path": "/etc"}), 403, "PathOutsideRoot")
    refused(
        delta_server.update({**served.body(d), "version": v + 2, "base_version": v + 1}), 409, "VersionError"
    )
    refused(delta_server.update(served.body(MISFIT["shape"][2](deltas, served))), 422, "ShapeMismatchError")
    text = metrics(delta_server)
    assert {s: metric(text, name) - before[s] for s, name in series.items()} == dict.fromkeys(series, 1.0)
    delta_server.assert_unharmed(served.before, version=v)


def with_digests(d, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], **wrong: str) -> None:
    """Add the additive digests (from the full tensors) to a delta's manifest; `wrong` breaks one."""
    m = json.loads((d / MANIFEST).read_text())
    for p in m["params"]:
        a, b = old[p["name"]].reshape(-1), new[p["name"]].reshape(-1)
        pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
        p.update(
            pre_digest=to_hex(partial_sum(pos, a[pos])),
            post_digest=to_hex(partial_sum(pos, b[pos])),
            digest=to_hex(tensor_sum(new[p["name"]])),
        )
        for field_, name in wrong.items():
            if name == p["name"]:
                p[field_] = combine(p[field_], "0" * 31 + "1")
    (d / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("field_", ["pre_digest", "post_digest"])
def test_digest_mismatches_are_400_before_any_write(delta_server, deltas, served, field_):
    d, new = served.next(deltas, f"bad-{field_}", [Q, DOWN], seed=21)
    with_digests(d, served.weights, new, **{field_: DOWN})
    error = refused(delta_server.update(served.body(d)), 400, "IntegrityError")
    assert error["param"] == DOWN and field_[:-7] in error["message"], error
    delta_server.assert_unharmed(served.before, version=served.version)


# The good updates: each moves the weights from what `served` says the server holds, and records it.


def moved(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """Params whose digest changed, without vLLM's `dp0:pp0:...:` rank prefix."""
    return {name.rsplit(":", 1)[-1] for name in before if after[name] != before[name]}


def test_apply_returns_metrics_and_changes_only_its_params(delta_server, deltas, served):
    d, new = served.next(deltas, "apply", [Q, DOWN], seed=11)
    resp = delta_server.update({**served.body(d), "path": str(d)})  # an absolute path under the root
    assert resp.status_code == 200, resp.text
    result = resp.json()
    manifest = json.loads((d / MANIFEST).read_text())
    assert result["version"] == served.version + 1 and result["replay"] is False
    assert result["changed"] == sum(p["changed"] for p in manifest["params"]) > 0
    assert result["bytes_read"] >= sum(f["bytes"] for f in manifest["files"])
    assert all(isinstance(result[key], float) for key in ("decode_s", "apply_s", "pause_s")), result
    assert len(result["ranks"]) == 1 and result["fallback"] == []
    assert moved(served.before.checksums, delta_server.checksums()) == {
        "model.layers.0.self_attn.qkv_proj.weight",
        DOWN,
    }
    served.committed(delta_server, new)
    status = delta_server.status()
    assert (
        status["healthy"]
        and status["version"] == served.version
        and status["last"]["version"] == served.version
    )
    assert served.before.greedy[0]


def test_non_idempotent_replays_are_409(delta_server, deltas, served):
    d, new = served.next(deltas, "relative", [Q], seed=12)  # ulp_zstd: relative to the old bits
    assert delta_server.update(served.body(d)).status_code == 200
    served.committed(delta_server, new)
    refused(delta_server.update({"path": d.name, "version": served.version}), 409, "VersionError")
    delta_server.assert_unharmed(served.before, version=served.version)
    other = deltas.write(
        "relative-other",
        served.next(deltas, "unused", [NORM], seed=13)[1],
        version=served.version,
        base_version=served.version - 1,
        old=served.weights,
    )
    refused(
        delta_server.update(
            {"path": other.name, "version": served.version, "base_version": served.version - 1}
        ),
        409,
        "VersionError",
    )
    delta_server.assert_unharmed(served.before, version=served.version)


def test_idempotent_replay_is_200_and_changes_nothing(delta_server, deltas, served):
    before = served.before.checksums
    d, new = served.next(deltas, "absolute", [NORM], seed=14, encoding="deltas_zstd")
    resp = delta_server.update(served.body(d))
    assert resp.status_code == 200, resp.text
    served.committed(delta_server, new)
    assert moved(before, served.before.checksums) == {NORM}
    resp = delta_server.update({"path": d.name, "version": served.version})
    assert resp.status_code == 200, resp.text
    assert resp.json()["replay"] is True
    delta_server.assert_unharmed(served.before, version=served.version)


def test_empty_delta_bumps_the_version_without_pausing(delta_server, deltas, served):
    d = deltas.write("empty", {}, version=served.version + 1, base_version=served.version)
    resp = delta_server.update(served.body(d))
    assert resp.status_code == 200, resp.text
    assert resp.json()["changed"] == 0 and resp.json()["pause_s"] == 0
    delta_server.assert_unharmed(served.before, version=served.version + 1)
    served.committed(delta_server, {})


def test_metrics_are_on_vllm_metrics(delta_server, deltas, served):
    """One update adds one to each histogram's count and sets the version gauge."""
    counted = (
        "vllm_delta:apply_seconds_count",
        "vllm_delta:decode_seconds_count",
        "vllm_delta:pause_seconds_count",
        "vllm_delta:bytes_read_count",
        "vllm_delta:changed_elements_count",
    )
    before = metrics(delta_server)
    d, new = served.next(deltas, "metrics", [DOWN], seed=15)
    assert delta_server.update(served.body(d)).status_code == 200
    served.committed(delta_server, new)
    after = metrics(delta_server)
    assert {s: metric(after, s) - metric(before, s) for s in counted} == dict.fromkeys(counted, 1.0)
    assert metric(after, "vllm_delta:weights_version") == served.version
    assert "vllm:" in after, "vLLM's own series are still there"


def test_digests_are_checked_and_a_full_verify_agrees(delta_server, deltas, served):
    """An update stating additive digests commits, and a full verify re-checks every digest and
    post_hash the updates so far stated (counted from what `served` recorded)."""
    d, new = served.next(deltas, "digests", [Q, DOWN], seed=16)
    with_digests(d, served.weights, new)
    resp = delta_server.update(served.body(d))
    assert resp.status_code == 200, resp.text
    served.committed(delta_server, new, digested=(Q, DOWN))
    resp = requests.post(
        f"{delta_server.url}/delta_updates/verify", headers=delta_server.headers(), timeout=120
    )
    assert resp.status_code == 200, resp.text
    report = resp.json()
    assert report["ok"], report
    assert (report["digests_checked"], report["hashes_checked"]) == (
        len(served.digested),
        len(served.hashed),
    ), (report, served.digested, served.hashed)
    assert delta_server.status()["fault"] is None
