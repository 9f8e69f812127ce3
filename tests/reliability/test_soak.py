"""Syncs under load against a real `vllm serve` (CPU): 8 completion streams, no failed request, and
the digest chain checked after every sync. 10 syncs in `make test`; 100 with `-m soak`."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.engine_pool import API_KEY, reset_to_checkpoint
from harness.soak import run_soak
from harness.vllm_engine import VllmServer

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


@pytest.fixture(scope="module")
def root(engine_pool) -> Path:
    return engine_pool.delta_root()


@pytest.fixture(scope="module")
def server(engine_pool, tiny_model_factory, root):
    """The session's shared Llama delta engine (harness/engine_pool), back on its checkpoint. It keeps
    idle connections 120 s (`KEEP_ALIVE_S` there): vLLM closes a keep-alive connection idle for 5 s,
    and under uvloop a server loop stalled past that (a 2-core CI box running other engines beside
    this one) runs the close before it reads the next request already waiting on the connection; the
    client sees RemoteDisconnected, which every production client retries. The soak asks whether a
    sync drops requests, so a stall must show as latency (`latency_syncing.max`), not as a drop."""
    model_dir = tiny_model_factory("llama")
    s = engine_pool.shared_llama(model_dir)
    reset_to_checkpoint(s, root, model_dir)
    return s


def _check(figures: dict, syncs: int, server: VllmServer) -> None:
    errors = [
        line for line in server.log_tail(100_000).splitlines() if "ERROR" in line or "Exception" in line
    ]
    assert figures["requests_failed"] == 0, (figures["failures"], errors[-20:])
    assert figures["chain_errors"] == [] and figures["syncs_verified"] == syncs
    assert figures["latency_baseline"]["n"] > 0 and figures["latency_syncing"]["n"] > 0


def test_ten_syncs_under_eight_streams(server, root, tiny_model_factory):
    figures = run_soak(
        server.url, API_KEY, tiny_model_factory("llama"), root, syncs=10, streams=8, baseline_s=5
    )
    print(figures)
    _check(figures, 10, server)


@pytest.mark.soak
def test_hundred_syncs_under_eight_streams(server, root, tiny_model_factory):
    figures = run_soak(
        server.url, API_KEY, tiny_model_factory("llama"), root, syncs=100, streams=8, baseline_s=20, seed=1
    )
    print(figures)
    _check(figures, 100, server)
