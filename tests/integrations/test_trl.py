"""TRL 1.16's real `GRPOTrainer(use_vllm=True, vllm_mode="server")` for a few CPU steps, its rollouts from the
session's shared Llama engine, its weight syncs through `use_delta` (the one line a user adds): after every
sync the engine equals a fresh load of the trainer's own `save_pretrained` (harness/trl_loop.py)."""

from __future__ import annotations

import pytest
import torch
from harness.engine_pool import API_KEY, checksums, reset_to_checkpoint

pytest.importorskip("trl")
pytestmark = [pytest.mark.heavy, pytest.mark.engine]


def test_grpo_syncs_deltas_exactly(engine_pool, tiny_model_factory, fresh_loader, tmp_path):
    from harness.trl_loop import run_grpo

    model_dir = tiny_model_factory("llama")
    server = engine_pool.shared_llama(model_dir)
    root = engine_pool.delta_root()
    reset_to_checkpoint(server, root, model_dir)
    seen = {}

    def bad_sync(client) -> None:
        """A sync the sender refuses (a tensor the model does not have) is recorded, never raised."""
        before = checksums(server.url)
        client.update_named_params([], iter([("not.a.param", torch.zeros(2))]))
        seen.update(client.status(), unchanged=checksums(server.url) == before)

    out = run_grpo(
        server.url, root, model_dir, tmp_path, 2, fresh_loader.checksums, api_key=API_KEY, then=bad_sync
    )
    assert out["steps"] == 2 and out["syncs"] == 3, out  # the first sync anchors; one delta after each step
    assert out["exact_after_every_sync"] and out["all_acked"] and out["failed_syncs"] == 0, out
    assert [s["anchor"] for s in out["per_sync"]] == [True, False, False]
    assert all(0 < b < out["full_sync_bytes"] for b in out["delta_bytes_per_sync"]), out
    assert seen["failed_syncs"] == 1 and "not.a.param" in seen["last_sync_error"] and seen["unchanged"], seen
