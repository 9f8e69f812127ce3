"""The per-phase trace of one sync on one rank (engine/trace.py): prepare fills `StagedUpdate.times`,
the commit adds its phases to the same object, and the phases add up to each side's wall time."""

from __future__ import annotations

import time

import torch
from harness.synthetic import device_check, tp_ranks

from vllm_delta.engine import worker as worker_module
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.trace import WORKER_COMMIT, WORKER_PREPARE, PhaseTimes
from vllm_delta.wire import iter_delta, open_delta

DC = device_check()


def _applier(tmp_path) -> tuple[DeltaApplier, dict]:
    """The tiny synthetic model's applier, with a delta of 30% of its elements at `tmp_path / "d"`."""
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    return DeltaApplier(model, meta), meta


def test_prepare_and_commit_phases_are_present_and_add_up_to_the_wall_time(tmp_path):
    applier, _ = _applier(tmp_path)
    applier.placements  # noqa: B018 - the probe runs at startup, not in the timed prepare
    start = time.perf_counter()
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0, decode_threads=2)
    prepare_s = time.perf_counter() - start
    prepared = dict(staged.times.seconds)
    assert set(prepared) == set(WORKER_PREPARE), prepared  # every declared phase is recorded
    assert all(s >= 0 for s in prepared.values())
    assert abs(sum(prepared.values()) - prepare_s) <= 0.1 * prepare_s, (prepared, prepare_s)
    commit_s = applier.commit(staged)
    committed = {p: s for p, s in staged.times.seconds.items() if p in WORKER_COMMIT}
    assert set(committed) == set(WORKER_COMMIT), committed
    assert {p: staged.times.seconds[p] for p in prepared} == prepared  # the commit adds, never resets
    assert abs(sum(committed.values()) - commit_s) <= 0.1 * commit_s, (committed, commit_s)


def test_staging_adds_its_phases_to_the_syncs_times(tmp_path):
    """`stage` records into the `PhaseTimes` it is given (a transport's, already holding `receive`)."""
    applier, meta = _applier(tmp_path)
    info = open_delta(tmp_path / "d")
    times = PhaseTimes()
    times.add("receive", 0.0)
    deltas = iter_delta(info, expected=meta, current_version=0)
    staged = applier.stage(
        info.manifest, deltas, version=1, replay=False, start=time.perf_counter(), times=times
    )
    assert staged.times is times and set(times.seconds) == set(WORKER_PREPARE), times.seconds


def test_the_workers_manifest_parse_is_in_its_receive_phase(tmp_path, monkeypatch):
    """The worker opens the delta (parses its manifest: tenths of a second at 10k tensors) before the
    applier's prepare, for its lineage check; that is `receive`, not the door's unexplained wait."""
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    _, (worker,) = tp_ranks(tmp_path / "model", base, tp=1)
    root = tmp_path / "root"
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    opened: list[float] = []

    def timed_open(*args, **kwargs):
        started = time.perf_counter()
        try:
            return open_delta(*args, **kwargs)
        finally:
            opened.append(time.perf_counter() - started)

    monkeypatch.setattr(worker_module, "open_delta", timed_open)
    worker.delta_probe()
    reply = worker.delta_prepare({"id": "x", "version": 1, "path": str(root / "v1"), "root": str(root)})
    assert reply["ok"] and len(opened) == 1, reply
    assert reply["phases"]["receive"] >= opened[0], (reply["phases"], opened)  # the open lies within it
