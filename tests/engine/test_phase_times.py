"""The per-phase trace of one sync on one rank (engine/trace.py): prepare fills `StagedUpdate.times`,
the commit adds its phases to the same object, and the phases add up to each side's wall time."""

from __future__ import annotations

import time

import torch
from harness.synthetic import device_check

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.trace import WORKER_COMMIT, WORKER_PREPARE

DC = device_check()


def test_prepare_and_commit_phases_are_present_and_add_up_to_the_wall_time(tmp_path):
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    applier.placements  # noqa: B018 - the probe runs at startup, not in the timed prepare
    start = time.perf_counter()
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0, decode_threads=2)
    prepare_s = time.perf_counter() - start
    prepared = dict(staged.times.seconds)
    assert {"receive", "decode", "locate", "digest", "stage"} <= set(prepared) <= set(WORKER_PREPARE)
    assert all(s >= 0 for s in prepared.values())
    assert abs(sum(prepared.values()) - prepare_s) <= 0.1 * prepare_s, (prepared, prepare_s)
    commit_s = applier.commit(staged)
    committed = {p: s for p, s in staged.times.seconds.items() if p in WORKER_COMMIT}
    assert set(committed) == set(WORKER_COMMIT), committed
    assert {p: staged.times.seconds[p] for p in prepared} == prepared  # the commit adds, never resets
    assert abs(sum(committed.values()) - commit_s) <= 0.1 * commit_s, (committed, commit_s)
