"""The transaction core under our route: every sync's trace (door phases timed, each rank's worker phases,
the slowest rank per phase adding up to the wall time), the last trace in the status, the Prometheus
histogram per phase, and the typed messages refusing a malformed reply at the boundary.

Two in-process TP ranks of the synthetic model run the real worker extension (harness/synthetic.py).
"""

from __future__ import annotations

import asyncio

import pytest
from harness.synthetic import InProcessEngine, device_check, tp_ranks
from prometheus_client import CollectorRegistry

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import PrepareRequest, StatusReply
from vllm_delta.engine.metrics import DeltaMetrics
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.engine.trace import DOOR, PHASES, PhaseTimes
from vllm_delta.wire import load_manifest, write_manifest
from vllm_delta.wire.additive import combine

DC = device_check()
CFG = DC.SIZES["tiny"]


@pytest.fixture
def synced(tmp_path):
    """(updater, the 200 answer of one non-empty sync)."""
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    _, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    updater = DeltaUpdater(InProcessEngine(workers), root, 1 << 20, [])
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    return updater, asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))


def test_the_answer_carries_the_trace_and_its_phases_add_up_to_the_wall_time(synced):
    updater, result = synced
    trace = result["trace"]
    assert set(trace) == {"phases", "ranks", "wall_s"} and trace["wall_s"] > 0
    assert set(DOOR) <= set(trace["phases"]) <= set(PHASES), trace["phases"]  # a non-empty delta pauses
    assert [r["rank"] for r in trace["ranks"]] == ["dp0:rank0", "dp0:rank1"]
    total = sum(trace["phases"].values())
    assert abs(total - trace["wall_s"]) <= 0.1 * trace["wall_s"], (total, trace)
    status = asyncio.run(updater.status())
    assert status["last"]["trace"] == trace and status["last"]["version"] == 1 and status["healthy"]


def test_each_phase_is_one_series_of_the_histogram(synced):
    _, result = synced
    registry = CollectorRegistry()
    DeltaMetrics(registry).observe(result)
    for phase in result["trace"]["phases"]:
        assert registry.get_sample_value("vllm_delta:sync_phase_seconds_count", {"phase": phase}) == 1, phase


def test_a_rank_reports_only_the_phases_of_its_step():
    """Prepare's reply carries the prepare phases, commit's the commit phases, of the one `PhaseTimes`."""
    times = PhaseTimes()
    for phase in ("decode", "stage", "scatter", "post_load"):
        times.add(phase, 0.5)
    assert times.as_dict(("receive", "decode", "stage")) == {"decode": 0.5, "stage": 0.5}
    assert times.as_dict(("scatter", "post_load")) == {"scatter": 0.5, "post_load": 0.5}
    assert PhaseTimes().as_dict(("decode",)) == {}  # a step that recorded no phases


def test_a_malformed_worker_reply_is_a_500_naming_the_field(tmp_path):
    class Renamed(InProcessEngine):
        async def collective_rpc(self, method, args=()):
            return [{"rank": 0, "versoin": 3}]

    updater = DeltaUpdater(Renamed([]), tmp_path, 1 << 20, [])
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.status())
    assert err.value.status == 500 and "version" in err.value.error["message"]


def test_the_staging_bound_has_one_name_on_the_wire():
    """`max_staged_bytes` only: the old `chunk_bytes` survives as a deprecated CLI flag, never inside."""
    request = PrepareRequest.model_validate({"id": "x", "version": 1, "max_staged_bytes": 64})
    assert request.max_staged_bytes == 64 and request.wire()["max_staged_bytes"] == 64
    with pytest.raises(ValueError, match="chunk_bytes"):
        PrepareRequest.model_validate({"id": "x", "version": 1, "chunk_bytes": 64})
    with pytest.raises(ValueError):
        StatusReply.model_validate({"version": 1, "surprise": True})


def _ranks(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    _, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    return base, workers, root, DeltaUpdater(InProcessEngine(workers), root, 1 << 20, [])


def test_an_empty_delta_commits_without_pausing(tmp_path):
    base, workers, root, updater = _ranks(tmp_path)
    paused = []
    engine = updater.engine

    async def pause_generation(mode: str, clear_cache: bool) -> None:
        paused.append(mode)

    engine.pause_generation = pause_generation
    DC.write_delta(root / "v1", base, base, version=1)
    result = asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert result["version"] == 1 and result["changed"] == 0 and result["pause_s"] == 0 and paused == []
    assert "pause" not in result["trace"]["phases"] and "resume" not in result["trace"]["phases"]
    assert all(w._delta().version == 1 for w in workers)


def test_ranks_that_disagree_leave_nothing_staged_on_any_rank(tmp_path):
    """Every rank prepares, then their digests disagree with the manifest: the core aborts what each
    staged."""
    base, workers, root, updater = _ranks(tmp_path)
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    manifest = load_manifest(root / "v1")
    entry = manifest.params[0]
    params = [
        p.model_copy(update={"post_digest": combine(entry.post_digest, "0" * 31 + "1")}) if p is entry else p
        for p in manifest.params
    ]
    write_manifest(root / "v1", manifest.model_copy(update={"params": params}))
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert err.value.status == 400 and set(err.value.error["ranks"]) == {"dp0:rank0", "dp0:rank1"}
    assert all(not w._delta().staged and w._delta().preparing is None for w in workers)
    assert all(w._delta().version == 0 for w in workers) and updater.fault is None
