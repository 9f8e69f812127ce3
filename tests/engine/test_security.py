"""Locked-down delta routes (docs/security.md): who may start a server, what a request may carry, and
what the workers will open.

Startup refusals run `vllm serve`'s own parser (and once the real command): no engine starts for
them. The route cases share one server started with a small body cap and a collective allowlist;
each bad input uses an otherwise valid delta directory, asserts the error type and the field it
names, and checks the engine was left as it was (weights digest-identical, same greedy tokens and
logprobs as before the cases).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import pytest
import requests

from harness.vllm_engine import VllmServer
from vllm_delta.engine import cli_args
from vllm_delta.native import ROOT_ENV
from vllm_delta.wire import flush_name

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

F = flush_name(0, 0)
Q = "model.layers.0.self_attn.q_proj.weight"
MAX_BODY = 64 << 10
TRAINERS = ["10.9.8.0/24", "trainer.example"]


# ---- startup: refused while the command line is parsed ------------------------------------------

@pytest.fixture
def serve_parser(monkeypatch, tmp_path):
    """`vllm serve`'s parser (vLLM's `make_arg_parser`), with no dev mode and no key in the environment."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The parser sets the delta flags in os.environ (for the engine it starts): setenv first, so
    # monkeypatch restores each name to its state before the test, unset included.
    for name in ("VLLM_SERVER_DEV_MODE", "VLLM_API_KEY", cli_args.ENV_FLAG, ROOT_ENV, "VLLM_PLUGINS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def parse(*flags: str):
        return make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["model", "--enable-delta-updates", "--delta-updates-root", str(tmp_path), *flags])

    return parse


REFUSED = {
    "no-key-all-interfaces": ([], {}, "lets whoever reaches this server"),
    "no-key-0.0.0.0": (["--host", "0.0.0.0"], {}, "lets whoever reaches this server"),
    "no-key-host-name": (["--host", "engine-0.internal"], {}, "lets whoever reaches this server"),
    "dev-mode-0": (["--host", "::"], {"VLLM_SERVER_DEV_MODE": "0"}, "lets whoever reaches this server"),
    "api-server-count": (["--api-key", "k", "--api-server-count", "2"], {}, "--api-server-count 2"),
    "data-parallel": (["--api-key", "k", "--data-parallel-size", "2"], {}, "--data-parallel-size 2"),
    "bad-trainer": (["--api-key", "k", "--delta-updates-collective-trainers", "a b"], {}, "host name"),
    "two-doors": (["--api-key", "k", "--weight-transfer-config", '{"backend": "delta"}'], {},
                  "cannot serve the same engine"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsafe_command_lines_are_refused_at_parse_time(serve_parser, monkeypatch, capsys, case):
    flags, env, message = REFUSED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        serve_parser(*flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


ALLOWED = {
    "api-key": (["--api-key", "k"], {}),
    "api-key-env": (["--host", "0.0.0.0"], {"VLLM_API_KEY": "k"}),
    "dev-mode": (["--host", "0.0.0.0"], {"VLLM_SERVER_DEV_MODE": "1"}),
    "loopback-v4": (["--host", "127.0.0.1"], {}),
    "loopback-v4-net": (["--host", "127.3.2.1"], {}),
    "loopback-v6": (["--host", "::1"], {}),
    "localhost": (["--host", "localhost"], {}),
    "unix-socket": (["--uds", "/tmp/vllm-delta-test.sock"], {}),
}


@pytest.mark.parametrize("case", ALLOWED)
def test_safe_command_lines_parse(serve_parser, monkeypatch, case):
    flags, env = ALLOWED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = serve_parser(*flags, "--delta-updates-collective-trainers", "10.0.0.0/8", "::1", "trainer-0")
    assert args.enable_delta_updates and args.delta_updates_max_body_bytes == cli_args.DEFAULT_MAX_BODY_BYTES
    assert args.delta_updates_collective_trainers == ["10.0.0.0/8", "::1", "trainer-0"]


def test_open_server_without_a_key_stops_before_any_engine_starts(tiny_model_factory, tmp_path):
    """The real command: `vllm serve` exits with argparse's usage error (2) instead of serving."""
    args = ["--enable-delta-updates", "--delta-updates-root", str(tmp_path), "--host", "0.0.0.0"]
    try:
        server = VllmServer(tiny_model_factory("llama"), tmp_path / "serve.log", extra_args=args,
                            env={"VLLM_SERVER_DEV_MODE": "0"}, startup_timeout_s=300)
    except RuntimeError as exc:
        refusal = str(exc)
    else:
        server.stop()
        pytest.fail("vllm serve started an open delta-updates server without an API key")
    assert "exited with 2" in refusal and "--api-key" in refusal and "VLLM_SERVER_DEV_MODE=1" in refusal


# ---- one server: body cap, collective allowlist, safe file opening ------------------------------

@pytest.fixture(scope="module")
def guarded(serve_deltas, tiny_model_factory, delta_root, tmp_path_factory) -> Iterator:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    extra = ["--delta-updates-max-body-bytes", str(MAX_BODY), "--delta-updates-collective-trainers", *TRAINERS]
    with serve_deltas(tiny_model_factory("llama"), delta_root, log, extra) as server:
        yield server


@pytest.fixture(scope="module")
def baseline(guarded):
    """Digests and greedy tokens + logprobs before any case (no case here may commit an update)."""
    status = guarded.status()
    assert status["healthy"] and status["version"] == 0, status
    return guarded.baseline()


def assert_unchanged(server, baseline) -> None:
    server.assert_unharmed(baseline, version=0)


def refused(resp: requests.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    return error


def good(deltas, label: str):
    return deltas.write(label, deltas.perturbed([Q], seed=5))


def test_body_over_the_cap_is_refused(guarded, deltas, baseline):
    body = {"path": good(deltas, "big-body").name, "version": 1, "base_version": 0}
    padded = json.dumps(body).encode()[:-1] + b" " * MAX_BODY + b"}"  # valid JSON, one cap too long
    error = refused(guarded.update(raw=padded), 413, "RequestTooLarge")
    assert str(MAX_BODY) in error["message"]

    def chunked():  # no Content-Length: the cap holds while the body streams in
        yield padded[:1000]
        yield padded[1000:]

    resp = requests.post(f"{guarded.url}/update_weights_delta", data=chunked(), timeout=60,
                         headers={"Content-Type": "application/json", **guarded.headers()})
    refused(resp, 413, "RequestTooLarge")
    assert_unchanged(guarded, baseline)


def collective_init(server, **overrides) -> requests.Response:
    body = {"master_addr": "10.9.8.7", "master_port": 29555, "world_size": 2, "backend": "gloo",
            "timeout_s": 1, **overrides}
    return requests.post(f"{server.url}/delta_updates/collective/init", json=body, headers=server.headers(),
                         timeout=120)


@pytest.mark.parametrize("addr", ["10.1.2.3", "::ffff:10.1.2.3", "trainer.example.evil", "attacker"])
def test_collective_init_refuses_trainers_outside_the_allowlist(guarded, baseline, addr):
    error = refused(collective_init(guarded, master_addr=addr), 403, "TrainerNotAllowed")
    assert addr in error["message"]
    assert_unchanged(guarded, baseline)


def test_collective_timeout_is_capped(guarded, baseline):
    error = refused(collective_init(guarded, timeout_s=3600), 400, "InvalidRequest")
    assert error["message"].startswith("timeout_s: "), error
    assert_unchanged(guarded, baseline)


def test_fifo_manifest_is_refused_without_hanging(guarded, deltas, baseline):
    d = good(deltas, "fifo-manifest")
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")
    resp = guarded.update({"path": d.name, "version": 1, "base_version": 0})  # 120 s client timeout
    error = refused(resp, 400, "FormatError")
    assert error["file"] == "manifest.json" and "regular file" in error["message"]
    assert_unchanged(guarded, baseline)


def test_fifo_flush_file_is_refused(guarded, deltas, baseline):
    d = good(deltas, "fifo-flush")
    (d / F).unlink()
    os.mkfifo(d / F)
    error = refused(guarded.update({"path": d.name, "version": 1, "base_version": 0}), 400, "FormatError")
    assert error["file"] == F and "regular file" in error["message"]
    assert_unchanged(guarded, baseline)


def test_symlinked_flush_file_is_not_followed_even_inside_the_root(guarded, deltas, baseline):
    """A link the API server's path check accepts (it stays under the root) is still never opened."""
    d = good(deltas, "symlink-flush")
    target = deltas.root / "elsewhere.safetensors"
    shutil.move(d / F, target)
    (d / F).symlink_to(target)
    error = refused(guarded.update({"path": d.name, "version": 1, "base_version": 0}), 400, "FormatError")
    assert error["file"] == F and "symlink" in error["message"]
    assert_unchanged(guarded, baseline)
