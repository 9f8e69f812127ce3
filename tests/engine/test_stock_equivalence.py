"""A delta-mode engine serves what stock vLLM serves on the same checkpoint (issue 11 item 10).

Why: every other engine test compares delta-mode engines with each other (or with digests), so a
difference that delta mode itself makes (it keeps CPU linear layers unpacked so they stay
updatable) would go unseen. Here a delta-mode engine on the base checkpoint (the session's shared
Llama engine, put back on it) is synced to a perturbed one; a stock `vllm serve` (no delta flags)
then serves the perturbed checkpoint directly. Their greedy tokens and logprobs must be identical
(they are, bit for bit, on CPU).

The stock server is also the flag-off check: without `--enable-delta-updates` it is stock vLLM.
It allowlists our endpoint plugin (`VLLM_PLUGINS`), so the plugin is loaded and must itself
decline to attach anything: no routes, no worker methods, no metrics, no flag in its engines.
"""

from __future__ import annotations

import pytest
import requests
from harness.engine_pool import API_KEY, HEADERS
from harness.perturb import perturb_checkpoint
from harness.vllm_engine import VllmServer, served_greedy

from vllm_delta import DeltaSender
from vllm_delta.wire.checkpoint import Checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,"]


def assert_flag_off_is_stock(server: VllmServer, child_environ) -> None:
    """What a flag-off server must not have: our routes, worker methods, metrics or env flag."""
    body = {"path": str(server.log_path.parent), "version": 1}
    assert requests.post(f"{server.url}/update_weights_delta", json=body, timeout=30).status_code == 404
    assert requests.get(f"{server.url}/delta_updates/status", timeout=30).status_code == 404
    rpc = requests.post(f"{server.url}/collective_rpc", json={"method": "delta_status"}, timeout=60)
    assert rpc.status_code >= 400, "workers must not have the delta methods"
    assert "vllm_delta:" not in requests.get(f"{server.url}/metrics", timeout=30).text
    engine_envs = child_environ(server)
    assert engine_envs and not any("VLLM_DELTA_UPDATES" in env for env in engine_envs)
    # The whole log: the refused RPC above appends its traceback, which can push startup out of a tail.
    assert "Loaded endpoint plugin delta_updates" in server.log_path.read_text(errors="replace")


def test_synced_delta_engine_generates_like_stock_vllm_on_that_checkpoint(
    tiny_model_factory, tmp_path, child_environ, delta_server
):
    base = tiny_model_factory("llama")
    new = perturb_checkpoint(base, tmp_path / "new", density=0.2, seed=5)
    server = delta_server  # the shared Llama engine, on `base`
    before = served_greedy(server.url, HEADERS, PROMPTS, 12)
    sender = DeltaSender(
        [server.url], "disk", server.root, api_key=API_KEY, version=server.status()["version"]
    )
    sender.seed_from_checkpoint(base)
    m = sender.sync(Checkpoint.open(new).iter_tensors())
    assert m["sender/all_acked"] == 1.0 and m["sender/changed_elements"] > 0
    synced = served_greedy(server.url, HEADERS, PROMPTS, 12)
    with VllmServer(new, tmp_path / "stock.log", env={"VLLM_PLUGINS": "delta_updates"}) as stock:
        want = served_greedy(stock.url, None, PROMPTS, 12)
        assert_flag_off_is_stock(stock, child_environ)
    assert synced != before, "the perturbed checkpoint must change what the model says"
    for (tokens, lps), (want_tokens, want_lps) in zip(synced, want, strict=True):
        assert tokens == want_tokens
        assert lps == want_lps, max(abs(a - b) for a, b in zip(lps, want_lps))
