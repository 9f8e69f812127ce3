"""O(changed) verification: counted-once partial digests per rank, summed and checked by the route
before any write; a full verify on demand.

Two TP ranks of the synthetic vLLM-shaped model (replicated norms, kv heads replicated past the
kv-head count, TP slices, fused qkv / gate_up, experts) run the real worker extension and
`DeltaUpdater` in one process; the manifest digests come from the full tensors on the sender side.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.wire import load_manifest, write_manifest
from vllm_delta.wire.additive import combine
from vllm_delta.wire.errors import IntegrityError

DC = device_check()
CFG = DC.SIZES["tiny"]
NORM = "model.layers.0.input_layernorm.weight"  # replicated on both ranks
K = "model.layers.0.self_attn.k_proj.weight"  # one kv head, replicated on both ranks
REPLICATED = ("layernorm.weight", "model.norm.weight", "k_proj.weight", "v_proj.weight")


def setup(tmp_path: Path, ep: bool = False):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2, ep=ep)
    root = tmp_path / "root"
    root.mkdir()
    return base, models, workers, DeltaUpdater(InProcessEngine(workers), root, 1 << 20, [])


def update(updater: DeltaUpdater, path: Path, version: int = 1) -> dict:
    return asyncio.run(
        updater.update(DeltaUpdateRequest(path=path.name, version=version, base_version=version - 1))
    )


def tamper(path: Path, name: str, **fields: str) -> None:
    manifest = load_manifest(path)
    params = [p.model_copy(update=fields) if p.name == name else p for p in manifest.params]
    write_manifest(path, manifest.model_copy(update={"params": params}))


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_partials_add_up_across_ranks_counting_replicas_once(tmp_path, ep):
    base, models, workers, updater = setup(tmp_path, ep)
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    result = update(updater, updater.root / "v1")
    assert result["version"] == 1
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(new, rank, 2, ep)) == []
    # Without the peers' coverage each rank counts the replicated elements: the sums differ.
    for w in workers:
        w._delta().applier.ownership = type(w._delta().applier.ownership)()
    DC.write_delta(updater.root / "v2", new, DC.step(new, 0.3, seed=2), version=2)
    req = {"id": "x", "path": str(updater.root / "v2"), "version": 2, "base_version": 1}
    replies = [w.delta_prepare(req) for w in workers]
    with pytest.raises(IntegrityError) as err:
        check_partials(replies)
    assert err.value.param.endswith(REPLICATED)


def test_wrong_post_digest_is_refused_before_any_write(tmp_path):
    base, models, _, updater = setup(tmp_path)
    new = DC.step(base, 0.3, seed=3)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    manifest = load_manifest(updater.root / "v1")
    entry = next(p for p in manifest.params if p.name == K)
    tamper(updater.root / "v1", K, post_digest=combine(entry.post_digest, "0" * 31 + "1"))
    with pytest.raises(UpdateError) as err:
        update(updater, updater.root / "v1")
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert err.value.error["param"] == K and "post-apply" in err.value.error["message"]
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(base, rank, 2)) == []
    assert not updater.engine.paused and updater.fault is None


@pytest.mark.parametrize("rank", [0, 1])
def test_engine_not_at_the_base_is_refused_by_the_pre_digest(tmp_path, rank):
    """One rank's shard drifted at a changed position: the route refuses, naming the tensor."""
    base, models, _, updater = setup(tmp_path)
    new = DC.step(base, 0.3, seed=4)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    name = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: rank r holds columns r*w..(r+1)*w
    shard = models[rank].model.layers[0].self_attn.o_proj.weight
    width = shard.shape[1]
    changed = torch.nonzero(base[name].view(torch.int16) != new[name].view(torch.int16))
    row, col = next((int(r), int(c)) for r, c in changed if c // width == rank)
    shard.data.view(torch.int16)[row, col - rank * width] += 7
    before = [{n: p.clone() for n, p in m.named_parameters()} for m in models]
    with pytest.raises(UpdateError) as err:
        update(updater, updater.root / "v1")
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert err.value.error["param"] == name and "pre-apply" in err.value.error["message"]
    for m, b in zip(models, before):
        assert all(torch.equal(p, b[n]) for n, p in m.named_parameters())


def test_full_verify_on_demand(tmp_path):
    base, models, _, updater = setup(tmp_path)
    new = DC.step(base, 0.3, seed=5)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    update(updater, updater.root / "v1")
    report = asyncio.run(updater.verify())
    assert report["ok"] and report["digests_checked"] == len(new) and report["digest_mismatched"] == []
    models[1].model.layers[1].self_attn.o_proj.weight.data.view(torch.int16)[0, 0] += (
        1  # rank 1 only holds it
    )
    report = asyncio.run(updater.verify())
    assert not report["ok"] and report["digest_mismatched"] == ["model.layers.1.self_attn.o_proj.weight"]


def test_placement_status_is_reported_before_the_first_update(tmp_path):
    _, _, _, updater = setup(tmp_path)

    async def probe_at_startup() -> tuple[dict, dict]:
        before = await updater.status()
        updater.start_probe()
        await updater._probe
        return before, await updater.status()

    before, after = asyncio.run(probe_at_startup())
    assert not before["placement"]["ready"] and before["placement"]["fallback"] is None
    placement = after["placement"]
    assert placement["ready"] and isinstance(placement["probe_s"], float) and placement["fallback"] == []
    assert placement["transformed"] == [] and after["last"] is None


def test_placement_is_ready_only_once_the_coverage_check_ran(tmp_path):
    """The startup coverage check takes the update lock after every rank probed; until it ran, `ready`
    stays false, so a client that pushes as soon as it turns true waits for no startup work."""
    _, _, workers, updater = setup(tmp_path)

    async def probe_behind_an_update() -> tuple[dict, dict]:
        async with updater.lock:  # as an update in flight: the coverage check waits for it
            updater.start_probe()
            while not all(w._delta().applier.probed for w in workers):
                await asyncio.sleep(0.01)
            probed = await updater.status()
        await updater._probe
        return probed, await updater.status()

    probed, checked = asyncio.run(probe_behind_an_update())
    assert not probed["placement"]["ready"] and probed["placement"]["coverage"] is None, probed
    assert checked["placement"]["ready"] and checked["placement"]["coverage"]["ok"], checked


def test_prepare_runs_on_a_background_thread_and_the_route_waits_for_it(tmp_path):
    """`delta_prepare_start` returns while the prepare still runs; the route polls until it ends."""
    base, models, workers, updater = setup(tmp_path)
    new = DC.step(base, 0.3, seed=6)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    release = threading.Event()
    for w in workers:
        prepare = w._delta().applier.prepare

        def blocked(*args, _prepare=prepare, **kwargs):
            assert release.wait(30), "the test never released the prepare"
            return _prepare(*args, **kwargs)

        w._delta().applier.prepare = blocked

    async def run() -> tuple[list[dict], dict]:
        task = asyncio.create_task(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
        while not all(w._delta().preparing for w in workers):
            await asyncio.sleep(0.01)  # the route's RPC returned: the prepare runs on its own
        polls = [w.delta_prepare_poll(w._delta().preparing.request_id) for w in workers]
        release.set()
        return polls, await task

    polls, result = asyncio.run(run())
    assert all(p["ok"] and not p["done"] for p in polls) and not updater.engine.paused
    assert result["version"] == 1 and isinstance(result["prepare_s"], float)
    for rank, m in enumerate(models):
        assert same_bits(m, loaded(new, rank, 2)) == []
