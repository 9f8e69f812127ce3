"""The batched apply: per sync, a constant number of ops per destination param, whatever the number
of checkpoint tensors behind it; the batched locate and digests equal the per-segment ones; and a
write that does not land is caught by the read-back after the scatter.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from harness.dispatch_log import OpLog
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine import commit
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.batched import Piece, locate
from vllm_delta.engine.commit import ApplyFault
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.placement import Segment
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater, guard_health
from vllm_delta.wire import iter_delta, open_delta

DC = device_check()
BF16 = torch.bfloat16


def moe(layers: int, experts: int):
    """A model whose every layer is MoE: 3 x `experts` checkpoint tensors per layer feed two fused params."""
    return DC.Config(
        vocab=64,
        hidden=16,
        layers=layers,
        heads=4,
        kv_heads=1,
        head_dim=4,
        inter=24,
        moe_layers=layers,
        experts=experts,
        moe_inter=8,
    )


def synced(tmp_path, cfg, encoding: str = "ulp_zstd"):
    """Prepare (from decoded deltas) and commit one 50% step under an op log; checks it is exact.

    Returns (ops logged, checkpoint tensors in the delta, destination params written)."""
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.5, seed=1)  # dense enough that every param, even a 16-element norm, changes
    DC.write_delta(tmp_path / "d", base, new, version=1, encoding=encoding)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    _ = applier.placements  # the probe runs the loaders: not part of a sync
    info = open_delta(tmp_path / "d")
    deltas = list(iter_delta(info, expected=meta, current_version=0))
    with OpLog() as log:
        staged = applier.stage(info.manifest, deltas, version=1, replay=False, start=0.0)
        destinations = len(staged.writes)
        applier.commit(staged)
    assert check_partials([{"digests": staged.digests, "expected": staged.expected}]) == 2 * len(deltas)
    want = DC.SyntheticLM(cfg)  # independent reference: the loaders themselves, on the new checkpoint
    want.load_weights(new.items())
    got = dict(model.named_parameters())
    assert all(torch.equal(p.view(torch.int16), got[n].view(torch.int16)) for n, p in want.named_parameters())
    return len(log.ops), len(deltas), destinations


@pytest.mark.parametrize("encoding", ["ulp_zstd", "deltas_zstd"])
def test_ops_per_sync_grow_with_destination_params_not_checkpoint_tensors(tmp_path, encoding):
    few = synced(tmp_path / "few", moe(1, 4), encoding)
    many = synced(tmp_path / "many", moe(1, 32), encoding)
    deeper = synced(tmp_path / "deeper", moe(2, 32), encoding)
    # (ops, checkpoint tensors, destination params): 8x the expert tensors, the same params, the same ops.
    assert few[1] == 3 + 6 + 3 * 4 and many[1] == 3 + 6 + 3 * 32 and few[2] == many[2] == 3 + 6
    assert many[0] == few[0], (few, many)
    # Twice the layers: the destination params grow, and the ops with them.
    assert deeper[2] == many[2] + 6 and deeper[1] == many[1] + 6 + 3 * 32
    assert 0 < deeper[0] - many[0] <= 6 * 160, (many, deeper)  # about 140 ops per added param


def test_prepare_and_commit_of_many_experts_run_on_meta(tmp_path):
    """The batched path on meta parameters: every op on the parameter's device after the upload."""
    cfg = moe(1, 32)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    with DC.DeltaWriter(
        tmp_path / "d", version=1, base_version=0, encoding="ulp_zstd"
    ) as w:  # no digests on meta
        for name, t in new.items():
            a, b = base[name].reshape(-1), t.reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            w.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    placements = DeltaApplier(DC.SyntheticLM(cfg), meta).placements
    model = DC.SyntheticLM(cfg, device="meta")
    applier = DeltaApplier(model, meta, placements=placements)
    with OpLog() as prepared:
        staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    assert len(staged.writes["model.layers.0.mlp.experts.w13_weight"]) == 1  # 64 expert tensors: one chunk
    assert all(c.offsets.device.type == "meta" for cs in staged.writes.values() for c in cs)
    with OpLog() as log:
        applier.commit(staged)
    assert len(log.named("index_copy_")) == len(staged.writes) == 3 + 6  # one scatter per destination
    assert all(op.devices() == {"meta"} for op in log.ops if op.inputs)
    for ops in (prepared, log):
        assert ops.copies("meta", "cpu") == [] and ops.host_reads() == []


SEGMENTS = [
    Segment("w", (6, 8), 0, (8, 1), 16, (8, 1)),  # the whole tensor, shifted
    Segment("w", (3, 8), 24, (8, 1), 100, (8, 1)),  # a row block (another rank holds the other rows)
    Segment("w", (6, 4), 1, (8, 2), 200, (4, 1)),  # every other column
    Segment("w", (6, 8), 0, (8, 1), 300, (1, 6)),  # stored transposed
    Segment("w", (2, 3), 19, (8, 1), 400, (3, 1)),  # a window
    # Size-1 dims, whose strides can be any number (here smaller than the next dim's range):
    Segment("w", (1, 6, 1, 8), 0, (48, 8, 1, 1), 500, (7, 8, 3, 1)),  # the same layout otherwise: a shift
    Segment("w", (1, 6, 1, 8), 0, (48, 8, 1, 1), 600, (7, 1, 3, 6)),  # stored transposed
]


def _brute_locate(seg: Segment, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices into `positions` the segment holds, their storage offsets), from every id it holds."""
    ids = torch.as_strided(torch.arange(48), seg.sizes, seg.src_strides, seg.src_offset).reshape(-1)
    dst = torch.as_strided(torch.arange(1000), seg.sizes, seg.dst_strides, seg.dst_offset).reshape(-1)
    where = dict(zip(ids.tolist(), dst.tolist()))
    idx = [i for i, p in enumerate(positions.tolist()) if p in where]
    return torch.tensor(idx, dtype=torch.int64), torch.tensor([where[positions[i].item()] for i in idx])


@pytest.mark.parametrize("chosen", [[0], [1], [0, 1], [2], [3, 4], [5], [6], [0, 5], [0, 1, 2, 3, 4, 5, 6]])
def test_batched_locate_equals_each_segments_own(chosen):
    """Independent reference: every id each segment holds, enumerated, one piece at a time."""
    g = torch.Generator().manual_seed(len(chosen))
    pieces, want_pos, want_off, want_slot = [], [], [], []
    for slot, k in enumerate(chosen):
        positions = torch.nonzero(torch.rand(48, generator=g) < 0.6).squeeze(1)
        values = torch.randn(positions.numel(), generator=g).to(BF16)
        seg = SEGMENTS[k]
        pieces.append(Piece(slot, positions, values, seg, 48))
        idx, offsets = _brute_locate(seg, positions)
        want_pos.append(positions[idx])
        want_off.append(offsets)
        want_slot.append(torch.full_like(idx, slot))
    got = locate(pieces)
    assert torch.equal(got.positions, torch.cat(want_pos))
    assert torch.equal(got.offsets, torch.cat(want_off))
    slots = got.slots if isinstance(got.slots, torch.Tensor) else torch.full_like(got.positions, got.slots)
    assert torch.equal(slots, torch.cat(want_slot))


def test_a_write_that_does_not_land_is_a_commit_fault_naming_the_tensor(tmp_path, monkeypatch):
    """A scatter that skips one entry of the fused experts (a fake: a real one cannot be made to)."""
    cfg = moe(1, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.2, seed=1)
    DC.write_delta(tmp_path / "d", base, new, version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    victim = "model.layers.0.mlp.experts.w2_weight"
    flat_victim = commit.flat_storage(applier.targets[victim])
    real = commit.scatter

    def misses_last(flat, chunk):
        if flat.untyped_storage().data_ptr() != flat_victim.untyped_storage().data_ptr():
            return real(flat, chunk)
        last = chunk.offsets[-1:].to(torch.int64)
        kept = flat.index_select(0, last)
        written = real(flat, chunk)
        flat.index_copy_(0, last, kept)  # the last write did not land
        return written

    monkeypatch.setattr(commit, "scatter", misses_last)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    with pytest.raises(ApplyFault, match="read-back") as fault:
        applier.commit(staged)
    assert fault.value.failed_at == victim and fault.value.suspect == [victim]


def test_a_write_that_does_not_land_keeps_the_engine_paused_and_unhealthy(tmp_path, monkeypatch):
    """Through the route, on two in-process TP ranks: the read-back fault of rank 1 is a commit fault."""
    cfg = DC.SIZES["tiny"]
    victim = "model.layers.1.mlp.experts.w13_weight"
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    models, workers = tp_ranks(tmp_path / "model", base, tp=2)
    root = tmp_path / "root"
    root.mkdir()
    engine = InProcessEngine(workers)
    updater = DeltaUpdater(engine, root, 1 << 20, [])
    app = FastAPI()
    app.get("/health")(lambda: {})
    guard_health(app)
    app.state.delta_updater = updater
    health = TestClient(app)
    storage = dict(models[1].named_parameters())[victim].untyped_storage().data_ptr()
    real = commit.scatter

    def misses_last(flat, chunk):
        written = real(flat, chunk)
        if flat.untyped_storage().data_ptr() == storage:
            last = chunk.offsets[-1:].to(torch.int64)
            flat.index_copy_(0, last, flat.index_select(0, last).view(torch.int16).add(1).view(flat.dtype))
        return written

    monkeypatch.setattr(commit, "scatter", misses_last)
    DC.write_delta(root / "v1", base, DC.step(base, 0.3, seed=1), version=1)
    with pytest.raises(UpdateError) as refused:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert refused.value.status == 500 and "read-back" in refused.value.error["message"]
    assert engine.paused and updater.fault["failed_at"] == victim and updater.fault["ranks"] == [1]
    assert health.get("/health").status_code == 503
    assert asyncio.run(updater.status())["ranks"][1]["fault"]["suspect"] == [victim]
    monkeypatch.setattr(commit, "scatter", real)  # a full anchor repairs it
    final = DC.step(base, 0.3, seed=2)
    with DC.DeltaWriter(root / "v2", version=2, base_version=None, encoding="indices") as w:
        for name, t in final.items():
            w.add(name, torch.arange(t.numel()), t.reshape(-1), shape=tuple(t.shape))
    asyncio.run(updater.update(DeltaUpdateRequest(path="v2", version=2)))
    assert not engine.paused and health.get("/health").status_code == 200
    assert all(same_bits(m, loaded(final, rank, 2)) == [] for rank, m in enumerate(models))
