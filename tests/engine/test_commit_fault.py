"""A commit that fails part-way never resumes serving: generation stays paused, /health answers
503 and the status names the version and the suspect tensors, until an anchor commits everywhere.

The fault is real: between prepare and commit (while the route pauses generation) one rank's
destination tensor is swapped for one too small, so its scatter raises at that tensor. Here two
in-process TP ranks show the rank bookkeeping; the same fault on a real `vllm serve` (health,
`/is_paused`, `/weight_checker` digests) is in test_prepare_while_serving.py, which shares that
module's server instead of starting another.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater, guard_health
from vllm_delta.wire import DeltaWriter

DC = device_check()
CFG = DC.SIZES["tiny"]
VICTIM = "model.layers.1.mlp.experts.w13_weight"


class FaultAtPause(InProcessEngine):
    """Swaps rank 1's destination `VICTIM` for a too-small tensor when the route pauses for the commit."""

    def __init__(self, workers) -> None:
        super().__init__(workers)
        self.armed = False
        self.original: torch.Tensor | None = None

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        await super().pause_generation(mode, clear_cache)
        if self.armed:
            targets = self.workers[1]._delta().applier.targets
            self.original, targets[VICTIM] = targets[VICTIM], torch.zeros(4, dtype=torch.bfloat16)
            self.armed = False

    def repair(self) -> None:
        self.workers[1]._delta().applier.targets[VICTIM] = self.original


def health_app(updater: DeltaUpdater) -> TestClient:
    app = FastAPI()
    app.get("/health")(lambda: {})
    guard_health(app)
    app.state.delta_updater = updater
    return TestClient(app)


def anchor(path, checkpoint: dict[str, torch.Tensor], version: int) -> None:
    with DeltaWriter(path, version=version, base_version=None, encoding="indices") as w:
        for name, t in checkpoint.items():
            w.add(name, torch.arange(t.numel()), t.reshape(-1), shape=tuple(t.shape))


def test_failed_commit_stays_paused_and_unhealthy_until_an_anchor(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    engine = FaultAtPause(workers)
    updater = DeltaUpdater(engine, root, 1 << 20, [])
    health = health_app(updater)
    assert health.get("/health").status_code == 200

    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(root / "v1", base, new, version=1)
    engine.armed = True
    try:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    except UpdateError as exc:
        assert exc.status == 500 and VICTIM in exc.error["message"]
    else:
        raise AssertionError("the commit should have failed")
    assert engine.paused, "a failed commit must not resume generation"
    assert (
        updater.fault["version"] == 1
        and updater.fault["failed_at"] == VICTIM
        and updater.fault["ranks"] == [1]
    )
    assert VICTIM in updater.fault["suspect"]
    reply = health.get("/health")
    assert reply.status_code == 503 and reply.json()["error"]["fault"]["failed_at"] == VICTIM
    status = asyncio.run(updater.status())
    assert not status["healthy"] and status["fault"]["version"] == 1
    assert status["ranks"][1]["fault"]["failed_at"] == VICTIM and status["ranks"][1]["dirty"]

    # Another delta is refused while the weights are suspect; the engine stays drained.
    DC.write_delta(root / "v2", new, DC.step(new, 0.3, seed=2), version=2)
    try:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v2", version=2, base_version=1)))
    except UpdateError as exc:
        assert exc.status in (409, 500)
    else:
        raise AssertionError("a plain delta must not repair a faulted engine")
    assert engine.paused and health.get("/health").status_code == 503

    # A full anchor, once the fault is gone, repairs every rank and resumes serving.
    engine.repair()
    final = DC.step(new, 0.3, seed=3)
    anchor(root / "v3", final, version=3)
    result = asyncio.run(updater.update(DeltaUpdateRequest(path="v3", version=3)))
    assert result["version"] == 3 and not engine.paused and updater.fault is None
    assert health.get("/health").status_code == 200
    assert asyncio.run(updater.status())["healthy"]
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(final, rank, 2)) == []
