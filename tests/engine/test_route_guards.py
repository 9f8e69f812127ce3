"""The delta routes' guards in-process: the API key (401) and the confinement of paths under the root (403).

Why in-process: the same guards are exercised through real `vllm serve` engines in
test_server_bad_input.py, but those run only in the heavy suite. Here the plugin's own router is
mounted on an in-process FastAPI app, exactly as `attach_router` mounts it, with the real
`DeltaUpdater` (vLLM's own bearer-key check) and real directories and symlinks under a real root.
The engine behind it is an object the guards must never reach: every refusal asserts it was not
touched. Requests the guards let through are stopped by the startup-probe refusal (checked after
both guards, before any engine call), so no engine is needed to see them pass.
"""

from __future__ import annotations

import os
from argparse import Namespace
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.testclient import TestClient

from vllm_delta.engine.cli_args import WORKER_EXTENSION, api_keys, delta_root
from vllm_delta.engine.http_errors import DeltaTransferError, UpdateError, parse_error
from vllm_delta.engine.request import DeltaUpdateRequest, prepare_request, resolve_version_dir
from vllm_delta.engine.request import delta_root as backend_root
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.plugin import DeltaUpdatesEndpoint
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.weight_transfer import worker_engine

KEY = "route-guard-key"
OTHER_KEY = "second-key"
# Every delta route, with a body it would otherwise accept for parsing.
ROUTES = [
    ("POST", "/update_weights_delta", {"path": "v1", "version": 1, "base_version": 0}),
    (
        "POST",
        "/delta_updates/collective/init",
        {"master_addr": "10.0.0.1", "master_port": 29500, "world_size": 2},
    ),
    ("POST", "/delta_updates/verify", None),
    ("GET", "/delta_updates/status", None),
]


class UnreachedEngine:
    """Stands where the engine client would be; records any use, so a test can assert there was none."""

    def __init__(self) -> None:
        self.touched: list[str] = []

    def __getattr__(self, name: str):
        self.touched.append(name)
        raise AssertionError(f"a guard let a request reach the engine ({name})")


@pytest.fixture
def root(tmp_path) -> Path:
    """A resolved root (as `--delta-updates-root` stores it) with one valid-looking version directory."""
    (tmp_path / "root").mkdir()
    root = delta_root(str(tmp_path / "root"))
    (root / "v1").mkdir()
    (root / "v1" / "manifest.json").write_text("{}")
    return root


@pytest.fixture
def outside(tmp_path) -> Path:
    """A version directory next to the root, not under it."""
    d = tmp_path / "escaped"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    return d


@pytest.fixture
def served(root):
    """The plugin's router on an in-process app: (client, updater, engine), keys `KEY` and `OTHER_KEY`."""
    args = Namespace(
        enable_delta_updates=True,
        delta_updates_root=root,
        worker_extension_cls=WORKER_EXTENSION,
        api_key=[KEY, OTHER_KEY],
        api_server_count=1,
        data_parallel_size=1,
    )
    app = FastAPI()
    app.state.args = args
    DeltaUpdatesEndpoint().attach_router(app)
    engine = UnreachedEngine()
    updater = DeltaUpdater(engine, root, 1 << 20, api_keys(args))
    updater.refused = {"model.norm.weight": "stops every request the guards let through"}
    app.state.delta_updater = updater
    with TestClient(app) as client:
        yield client, updater, engine


def post_update(client: TestClient, path: str, headers: dict | None = None):
    body = {"path": path, "version": 1, "base_version": 0}
    return client.post(
        "/update_weights_delta",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers,
    )


def error_of(resp, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    return error


# ---- authentication -----------------------------------------------------------------------------

BAD_AUTH = {
    "none": {},
    "empty": {"Authorization": ""},
    "wrong-key": {"Authorization": "Bearer wrong-key"},
    "key-prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
    "key-extended": {"Authorization": f"Bearer {KEY}x"},
    "basic-scheme": {"Authorization": f"Basic {KEY}"},
    "bare-key": {"Authorization": KEY},
    "x-api-key": {"X-API-Key": KEY},
}


@pytest.mark.parametrize("method,url,body", ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("auth", BAD_AUTH)
def test_every_route_refuses_a_missing_or_wrong_key(served, method, url, body, auth):
    client, _, engine = served
    resp = client.request(method, url, json=body, headers=BAD_AUTH[auth])
    error_of(resp, 401, "Unauthorized")
    assert engine.touched == []


def test_the_key_is_checked_before_the_body_is_read(served):
    """Without a key, a malformed or oversized body is a 401, not a 400 or 413 that reveals the parser."""
    client, updater, engine = served
    for raw in (b"{not json", b" " * (updater.max_body_bytes + 1)):
        resp = client.post("/update_weights_delta", content=raw, headers={"Content-Type": "application/json"})
        error_of(resp, 401, "Unauthorized")
    assert engine.touched == []


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"Bearer {OTHER_KEY}"])
def test_a_valid_key_passes_the_guard(served, header):
    """Any configured key, scheme case-insensitive as vLLM's middleware has it; the request then stops
    at the probe refusal, after the guards and before the engine."""
    client, _, engine = served
    error_of(post_update(client, "v1", {"Authorization": header}), 500, "UnservableLoader")
    assert engine.touched == []


def test_no_configured_key_means_no_key_check(root):
    """Keyless servers are allowed only on loopback or in dev mode (checked at parse time, test_security)."""
    updater = DeltaUpdater(UnreachedEngine(), root, 1 << 20, [])
    updater.authorize(
        Request({"type": "http", "method": "POST", "path": "/update_weights_delta", "headers": []})
    )


# ---- path confinement through the route ---------------------------------------------------------


def escaping_paths(root: Path, outside: Path) -> dict[str, str]:
    """Each way out of the root, built on disk: name -> the request's `path`.

    `empty` has no entries, so only the check of the directory itself (not of its entries) refuses it.
    """
    empty = outside.parent / "empty-outside"
    empty.mkdir(exist_ok=True)
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    (root / "link-empty").symlink_to(empty, target_is_directory=True)
    (root / "v-linked-file").mkdir()
    (root / "v-linked-file" / "manifest.json").symlink_to(outside / "manifest.json")
    (root / "v-linked-dir-entry").mkdir()
    (root / "v-linked-dir-entry" / "sub").symlink_to(outside, target_is_directory=True)
    return {
        "absolute-outside": str(outside),
        "dotdot": f"../{outside.name}",
        "dotdot-via-subdir": f"v1/../../{outside.name}",
        "dotdot-via-link": f"link-out/../{outside.name}",
        "root-parent": "..",
        "etc": "/etc",
        "symlinked-dir": "link-out",
        "symlinked-dir-inside": "link-out/.",
        "entry-links-out": "v-linked-file",
        "dir-entry-links-out": "v-linked-dir-entry",
        "absolute-dotdot": f"{root}/../{outside.name}",
        "empty-absolute": str(empty),
        "empty-dotdot": f"../{empty.name}",
        "empty-dotdot-via-subdir": f"v1/../../{empty.name}",
        "empty-symlinked": "link-empty",
    }


def test_paths_outside_the_root_are_403_and_reach_nothing(served, root, outside):
    client, _, engine = served
    for case, path in escaping_paths(root, outside).items():
        error = error_of(post_update(client, path), 403, "PathOutsideRoot")
        assert "outside" in error["message"], (case, error)
    assert engine.touched == []


@pytest.mark.parametrize(
    "path,reason", [("missing", "not a directory"), ("v1/manifest.json", "not a directory"), ("v1\0", "NUL")]
)
def test_paths_under_the_root_that_are_no_directory_are_400(served, path, reason):
    client, _, engine = served
    error = error_of(post_update(client, path), 400, "NotADeltaDirectory")
    assert reason in error["message"]
    assert engine.touched == []


@pytest.mark.parametrize("name", ["../manifest.json", "..", ".", "", "a/b", "a\\b", "x\0"])
def test_file_names_that_leave_the_version_directory_are_400(served, name):
    client, _, engine = served
    body = {"path": "v1", "version": 1, "base_version": 0, "files": [name]}
    error = error_of(
        client.post("/update_weights_delta", json=body, headers={"Authorization": f"Bearer {KEY}"}),
        400,
        "InvalidRequest",
    )
    assert error["message"].startswith("files")
    assert engine.touched == []


# ---- path confinement: what resolves, and to where ------------------------------------------------


def test_a_relative_path_is_taken_under_the_root_never_the_working_directory(root, outside, monkeypatch):
    monkeypatch.chdir(outside.parent)  # the working directory holds `escaped` and a decoy `v1`
    (outside.parent / "v1").mkdir(exist_ok=True)
    assert resolve_version_dir("v1", root) == root / "v1"
    with pytest.raises(UpdateError, match="is not a directory") as err:
        resolve_version_dir(outside.name, root)  # exists in the working directory, not under the root
    assert err.value.error["type"] == "NotADeltaDirectory"


def test_paths_that_stay_under_the_root_resolve_to_their_real_directory(root):
    (root / "link-in").symlink_to(root / "v1", target_is_directory=True)
    (root / "v2").mkdir()
    (root / "v2" / "manifest.json").symlink_to(root / "v1" / "manifest.json")  # a link that stays inside
    for path, real in {
        "v1": "v1",
        "./v1": "v1",
        str(root / "v1"): "v1",
        "v2/../v1": "v1",
        "link-in": "v1",
        "v2": "v2",
        f"{root}/v2/../v2": "v2",
    }.items():
        assert resolve_version_dir(path, root) == root / real, path


def test_the_root_is_compared_by_component_not_by_prefix(root):
    """`/x/root-evil` starts with `/x/root` as a string but is not under it."""
    sibling = root.parent / f"{root.name}-evil"
    sibling.mkdir()
    for path in (str(sibling), f"../{sibling.name}"):
        with pytest.raises(UpdateError) as err:
            resolve_version_dir(path, root)
        assert err.value.error["type"] == "PathOutsideRoot"


# ---- the `delta` weight-transfer backend: the same confinement on the worker side -----------------


def test_native_backend_confines_paths_to_its_root(root, outside, monkeypatch):
    """The worker resolves `update_info.path` under `VLLM_DELTA_UPDATES_ROOT` before anything opens it,
    and its refusal's text comes back to the front end as the same 403."""
    monkeypatch.setenv(ROOT_ENV, str(root))
    for case, path in escaping_paths(root, outside).items():  # the worker's request, as it raises it
        with pytest.raises(DeltaTransferError) as exc, worker_engine._raised():
            prepare_request(DeltaUpdateRequest(path=path, version=1, base_version=0), backend_root(), None)
        relayed = parse_error(f"RPC failed: {exc.value}")  # as vLLM relays a worker's exception
        assert relayed is not None and relayed.status == 403, (case, str(exc.value))
        assert relayed.error["type"] == "PathOutsideRoot", case
    request = prepare_request(DeltaUpdateRequest(path="v1", version=1, base_version=0), backend_root(), None)
    assert request.path == str(root / "v1") and request.root == str(root)
    assert os.path.realpath(request.path) == request.path
