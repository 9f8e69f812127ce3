"""`vllm serve` flags: without `--enable-delta-updates` it is stock vLLM; a half-configured flag fails.

The flag-off server allowlists our endpoint plugin (`VLLM_PLUGINS`), so the plugin is loaded and
must itself decline to attach anything.
"""

from __future__ import annotations

import pytest
import requests

from harness.vllm_engine import VllmServer

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


def test_flag_off_is_stock_vllm(tiny_model_factory, tmp_path, child_environ):
    with VllmServer(tiny_model_factory("llama"), tmp_path / "serve.log",
                    env={"VLLM_PLUGINS": "delta_updates"}) as server:
        body = {"path": str(tmp_path), "version": 1}
        assert requests.post(f"{server.url}/update_weights_delta", json=body, timeout=30).status_code == 404
        assert requests.get(f"{server.url}/delta_updates/status", timeout=30).status_code == 404
        rpc = requests.post(f"{server.url}/collective_rpc", json={"method": "delta_status"}, timeout=60)
        assert rpc.status_code >= 400, "workers must not have the delta methods"
        assert "vllm_delta:" not in requests.get(f"{server.url}/metrics", timeout=30).text
        assert server.complete("The quick brown fox", max_tokens=4)["text"]
        engine_envs = child_environ(server)
        assert engine_envs and not any("VLLM_DELTA_UPDATES" in env for env in engine_envs)
        log = server.log_tail(10_000)
    assert "Loaded endpoint plugin delta_updates" in log


def test_flag_without_root_stops_the_server(tiny_model_factory, tmp_path):
    with pytest.raises(RuntimeError, match="exited") as exc:
        VllmServer(tiny_model_factory("llama"), tmp_path / "serve.log", extra_args=["--enable-delta-updates"])
    assert "--enable-delta-updates requires --delta-updates-root DIR" in str(exc.value)
