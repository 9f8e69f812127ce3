"""The weight-transfer door over the transaction core, in one process: vLLM's `/update_weights` is the
core's prepare and agreement, `/finish_weight_update` its commit (then vLLM's own finish), a refusal
closes vLLM's session. The real-engine story is tests/weight_transfer/test_native_backend.py.

Two in-process TP ranks run the real worker extension behind the backend's one worker RPC
(`worker_rpc`'s dispatch, without vLLM's worker around it).
"""

from __future__ import annotations

import asyncio

import pytest
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.weight_transfer import worker_engine
from vllm_delta.weight_transfer.routes import WeightTransferDoor

DC = device_check()
CFG = DC.SIZES["tiny"]


class BackendEngine(InProcessEngine):
    """vLLM's engine client as the door sees it: the backend's worker RPC, vLLM's session calls."""

    def __init__(self, workers) -> None:
        super().__init__(workers)
        self.calls: list[str] = []
        self.weight_version: str | None = None

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        assert method == worker_engine.WORKER_RPC
        name, *rest = args
        self.calls.append(name)
        if name == "end_session":
            return [{"ok": True} for _ in self.workers]
        assert name in worker_engine.CORE_RPCS, name
        return [getattr(w, f"delta_{name}")(*rest) for w in self.workers]

    async def finish_weight_update(self, weight_version: str | None) -> None:
        self.weight_version = weight_version

    async def get_weight_version(self) -> str | None:
        return self.weight_version


@pytest.fixture
def setup(tmp_path, monkeypatch):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv(ROOT_ENV, str(root))
    engine = BackendEngine(workers)
    return base, models, root, engine, WeightTransferDoor(engine)


def test_update_then_finish_commits_through_the_core(setup):
    base, models, root, engine, door = setup
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(root / "v1", base, new, version=1)
    prepared = asyncio.run(door.update({"path": "v1", "version": 1, "base_version": 0}))
    assert set(prepared) == {"prepare_s", "tokens_during_prepare"}
    assert all(same_bits(m, loaded(base, r, 2)) == [] for r, m in enumerate(models)), "prepare wrote weights"
    done = asyncio.run(door.finish("1"))
    assert done["version"] == 1 and done["changed"] > 0 and engine.weight_version == "1"
    assert set(done["trace"]) == {"phases", "ranks", "wall_s"} and "pause" in done["trace"]["phases"]
    assert not engine.paused
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(new, rank, 2)) == []
    status = asyncio.run(door.status())
    assert status["version"] == 1 and status["weight_version"] == "1" and status["healthy"]
    assert all(isinstance(status["last"][k], float) for k in ("pause_s", "apply_s"))
    assert asyncio.run(door.finish("again")) is None  # nothing prepared: only vLLM's finish
    assert engine.weight_version == "again"


def test_the_door_probes_at_startup(setup):
    """As our route's: the placement learned, the kernels compiled and the ranks' coverage checked
    before any update, so the first one asks for none of it."""
    base, _, root, engine, door = setup

    async def startup() -> dict:
        door.start_probe()
        await door._probe
        return await door.status()

    placement = asyncio.run(startup())["placement"]
    assert engine.calls == ["probe", "coverage", "set_peers", "status"], engine.calls
    assert placement["ready"] and placement["coverage"]["ok"], placement
    engine.calls.clear()
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    asyncio.run(door.update({"path": "v1", "version": 1, "base_version": 0}))
    assert asyncio.run(door.finish("1"))["version"] == 1
    assert not {"probe", "coverage", "set_peers"} & set(engine.calls), engine.calls


def test_a_refusal_ends_the_session_and_writes_nothing(setup):
    base, models, root, engine, door = setup
    for info, status, kind in [
        ({"path": "../elsewhere", "version": 1}, 403, "PathOutsideRoot"),
        ({"path": "v1", "version": "four"}, 400, "InvalidRequest"),
        ({"path": "missing", "version": 1, "base_version": 0}, 400, "NotADeltaDirectory"),
    ]:
        engine.calls.clear()
        with pytest.raises(UpdateError) as err:
            asyncio.run(door.update(info))
        assert err.value.status == status and err.value.error["type"] == kind, info
        assert engine.calls[-1] == "end_session", engine.calls
    DC.write_delta(root / "v2", base, DC.step(base, 0.3, seed=1), version=2)  # not at the engine's version
    with pytest.raises(UpdateError) as err:
        asyncio.run(door.update({"path": "v2", "version": 2, "base_version": 1}))
    assert err.value.status == 409 and engine.calls[-2:] == ["abort", "end_session"], engine.calls
    assert door.prepared is None and asyncio.run(door.finish("x")) is None
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(base, rank, 2)) == []
