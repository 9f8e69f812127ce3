"""The transaction core's guards, each pinned by a test that fails if that one guard is dropped
(docs/results/mutants.md, session 13): a refusal anywhere in a prepare stops the update before any
write and drops what every rank staged, a commit RPC that raised faults the engine until an anchor,
and the trace takes its worker phases from the critical (slowest) rank.

Two in-process TP ranks run the real worker extension (harness/synthetic.py); the engine client
around them only injects the one event a test is about (a lost commit RPC, a slow or refusing rank,
a failed pause), since the core's contract is its workers' replies.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import CommitReply, PrepareReply
from vllm_delta.engine.replicas import summarize, trace_of, worker_seconds
from vllm_delta.engine.request import DeltaUpdateRequest, prepare_request
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.engine.trace import PhaseTimes
from vllm_delta.wire import DeltaWriter

DC = device_check()
CFG = DC.SIZES["tiny"]


class Engine(InProcessEngine):
    """The in-process engine client, counting pauses, with one injected event at a time."""

    def __init__(self, workers) -> None:
        super().__init__(workers)
        self.pauses = 0
        self.lose_commit = False  # the next `delta_commit` RPC raises before reaching the workers
        self.hold_back = False  # rank 1's polls answer "not done" until rank 0 is done
        self.poll_refusal: dict | None = None  # rank 1's polls answer this, not done
        self.start_refusal: dict | None = None  # rank 1's prepare_start answers this
        self.pause_fails = False

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "delta_commit" and self.lose_commit:
            self.lose_commit = False
            raise ConnectionError("the engine core's RPC was lost")
        if method == "delta_prepare_start" and self.start_refusal is not None:
            return [self.workers[0].delta_prepare_start(*args), self.start_refusal]
        if method != "delta_prepare_poll" or not (self.hold_back or self.poll_refusal):
            return await super().collective_rpc(method, args)
        # Rank 1 is answered for, without asking it (its prepare runs on and is polled once released).
        replies = [self.workers[0].delta_prepare_poll(*args), self.poll_refusal or {"done": False, "rank": 1}]
        self.hold_back = self.hold_back and not replies[0]["done"]
        return replies

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        if self.pause_fails:
            raise RuntimeError("the scheduler would not pause")
        self.pauses += 1
        await super().pause_generation(mode, clear_cache)


@pytest.fixture
def rig(tmp_path):
    """(base checkpoint, models, root, engine, updater) at version 0."""
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    engine = Engine(workers)
    return base, models, root, engine, DeltaUpdater(engine, root, 1 << 20, [])


def staged(engine: Engine) -> list[int]:
    return [len(w._delta().staged) for w in engine.workers]


def test_a_lost_commit_rpc_faults_until_an_anchor_and_a_plain_delta_does_not_clear_it(rig):
    base, models, root, engine, updater = rig
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(root / "v1", base, new, version=1)
    engine.lose_commit = True
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert err.value.status == 500
    assert updater.fault is not None and engine.paused, "an unknown commit outcome leaves generation paused"
    assert not asyncio.run(updater.status())["healthy"]
    # The ranks are clean (the RPC never reached them), so a plain delta commits on all of them; the
    # core still cannot vouch for the weights: it stays faulted and paused.
    result = asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert result["version"] == 1 and updater.fault is not None and engine.paused
    with DeltaWriter(root / "v2", version=2, base_version=None, encoding="indices") as w:  # an anchor
        for name, t in new.items():
            w.add(name, torch.arange(t.numel()), t.reshape(-1), shape=tuple(t.shape))
    asyncio.run(updater.update(DeltaUpdateRequest(path="v2", version=2)))
    assert updater.fault is None and not engine.paused and asyncio.run(updater.status())["healthy"]
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(new, rank, 2)) == []


def test_the_core_waits_for_every_rank_before_it_commits(rig):
    base, models, root, engine, updater = rig
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(root / "v1", base, new, version=1)
    engine.hold_back = True
    result = asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert result["version"] == 1
    assert [r["rank"] for r in result["trace"]["ranks"]] == ["dp0:rank0", "dp0:rank1"]
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(new, rank, 2)) == []


REFUSED = {"ok": False, "status": 507, "error": {"type": "Refused", "message": "rank 1 cannot stage it"}}


@pytest.mark.parametrize("where", ["prepare_start", "prepare_poll"])
def test_one_rank_refusing_its_prepare_refuses_the_update_and_writes_nothing(rig, where):
    base, models, root, engine, updater = rig
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    if where == "prepare_start":
        engine.start_refusal = {**REFUSED, "done": False}
    else:
        engine.poll_refusal = {**REFUSED, "done": False}
    with pytest.raises(UpdateError) as err:
        update = updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0))
        asyncio.run(asyncio.wait_for(update, 10))  # a refusal waited past would poll forever
    assert err.value.status == 507 and err.value.error["type"] == "Refused", err.value.error
    assert engine.pauses == 0 and staged(engine) == [0, 0]
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(base, rank, 2)) == []


def test_a_failed_pause_drops_what_every_rank_staged(rig):
    base, models, root, engine, updater = rig
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    engine.pause_fails = True
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert err.value.status == 500 and "pause" in err.value.error["message"]
    assert staged(engine) == [0, 0] and updater.fault is None
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(base, rank, 2)) == []


def test_an_empty_delta_whose_commit_fails_does_not_run_the_door_s_finish(rig):
    base, _, root, engine, updater = rig
    DC.write_delta(root / "v1", base, base, version=1)
    core, finished = updater, []
    request = DeltaUpdateRequest(path="v1", version=1, base_version=0)

    async def run() -> None:
        sync = await core.prepare(prepare_request(request, root, 1 << 20))
        engine.workers[1]._delta().staged.clear()  # rank 1 lost what it staged: its commit refuses

        async def then() -> None:
            finished.append(True)

        await core.commit(sync, then=then)

    with pytest.raises(UpdateError) as err:
        asyncio.run(run())
    assert err.value.status == 409 and finished == []


def _prepared(rank: int, **phases: float) -> PrepareReply:
    return PrepareReply(rank=rank, dp=0, phases=phases, total_changed=1)


def _committed(rank: int, version: int = 1, **phases: float) -> CommitReply:
    return CommitReply(rank=rank, dp=0, version=version, phases=phases)


def test_the_trace_takes_its_worker_phases_from_the_critical_rank():
    """The prepare's phases are rank 0's (4 s in all), the commit's rank 1's: not each phase's maximum
    (decode 3 + stage 2 = 5 s, more than any rank took, which broke the phases' sum under load)."""
    prepared = [_prepared(0, decode=3.0, stage=1.0), _prepared(1, decode=1.0, stage=2.0)]
    committed = [_committed(0, scatter=0.5, read_back=0.1), _committed(1, scatter=0.7)]
    trace = trace_of({"agree": 0.1, "pause": 0.2}, prepared, committed, wall_s=4.0)
    assert trace["phases"] == {"decode": 3.0, "stage": 1.0, "scatter": 0.7, "agree": 0.1, "pause": 0.2}
    assert list(trace["phases"]) == ["decode", "stage", "scatter", "agree", "pause"]  # in PHASES order
    assert trace["ranks"][1] == {"rank": "dp0:rank1", "phases": {"decode": 1.0, "stage": 2.0, "scatter": 0.7}}
    assert worker_seconds(prepared, commit=False) == 4.0 and worker_seconds(committed, commit=True) == 0.7


def test_a_phase_entered_twice_is_the_sum_of_both():
    times = PhaseTimes()
    times.add("agree", 0.25)
    times.add("agree", 0.5)
    assert times.as_dict() == {"agree": 0.75}


def test_ranks_that_committed_different_versions_are_a_500():
    prepared = [_prepared(0), _prepared(1)]
    with pytest.raises(UpdateError) as err:
        summarize(prepared, [_committed(0, version=1), _committed(1, version=2)], 0.0)
    assert err.value.status == 500 and "different versions" in err.value.error["message"]
