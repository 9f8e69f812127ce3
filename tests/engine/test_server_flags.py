"""`vllm serve` flags: a half-configured `--enable-delta-updates` stops the server.

(Flag off = stock vLLM is checked on the stock server of test_stock_equivalence.py.)
"""

from __future__ import annotations

import pytest

from harness.vllm_engine import VllmServer

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


def test_flag_without_root_stops_the_server(tiny_model_factory, tmp_path):
    with pytest.raises(RuntimeError, match="exited") as exc:
        VllmServer(tiny_model_factory("llama"), tmp_path / "serve.log", extra_args=["--enable-delta-updates"])
    assert "--enable-delta-updates requires --delta-updates-root DIR" in str(exc.value)
