"""Locate on the destination's device (engine/batched.py `locate(pieces, device)`): the same staged
offsets, values and digests as the host path, bit for bit, with only the owned positions and values
crossing host to device and no device-to-host sync in the per-destination work.

Why on the CPU: CI has no GPU; `batched.FORCE_DEVICE_PATH` takes the device path there, so the two
paths' results compare exactly. On `meta` (no values) the logged ops show where each ran.
"""

from __future__ import annotations

import pytest
import torch
from harness.dispatch_log import OpCount, OpLog
from harness.synthetic import device_check
from torch.overrides import TorchFunctionMode

from vllm_delta.engine import batched
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.batched import Piece, locate
from vllm_delta.engine.placement import Segment
from vllm_delta.engine.stager import Stager
from vllm_delta.wire import iter_delta, open_delta

DC = device_check()
BF16 = torch.bfloat16
# Every segment kind of test_batched_apply, and each alone or mixed (shift, row block, strided, transposed,
# window).
from test_batched_apply import SEGMENTS, moe  # noqa: E402


class DeviceLiterals(TorchFunctionMode):
    """`torch.tensor(data, device=...)` off the host: a blocking copy (a sync on CUDA) that the
    dispatch log cannot see (its copy runs below the dispatcher), so it is caught at the Python API."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in (torch.tensor, torch.as_tensor)
            and torch.device(kwargs.get("device") or "cpu").type != "cpu"
        ):
            self.calls.append(f"{func.__name__}(device={kwargs['device']})")
        return func(*args, **kwargs)


def _pieces(chosen: list[int], seed: int) -> list[Piece]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot, k in enumerate(chosen):
        positions = torch.nonzero(torch.rand(48, generator=g) < 0.6).squeeze(1)
        out.append(
            Piece(slot, positions, torch.randn(positions.numel(), generator=g).to(BF16), SEGMENTS[k], 48)
        )
    return out


def _slots(located) -> torch.Tensor:
    s = located.slots
    return s if isinstance(s, torch.Tensor) else torch.full_like(located.positions, s)


@pytest.mark.parametrize(
    "chosen", [[0], [1], [1, 1], [2], [3, 4], [5], [6], [0, 5], [1, 4, 2], [0, 1, 2, 3, 4, 5, 6]]
)
@pytest.mark.parametrize("there", [False, True], ids=["host-decoded", "device-decoded"])
def test_device_locate_equals_host_locate(chosen, there):
    """Positions decoded on the host (filtered there, then uploaded) or on the device (masked there)."""
    pieces = _pieces(chosen, len(chosen))
    host = locate(pieces)
    dev = locate(pieces, torch.device("cpu"), there=there)
    for a, b in [
        (host.positions, dev.positions),
        (host.offsets, dev.offsets),
        (_slots(host), _slots(dev)),
        (host.values.view(torch.int16), dev.values.view(torch.int16)),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("chosen", [[1, 4, 2], [0, 1, 2, 3, 4, 5, 6]])
def test_device_locate_on_meta_uploads_once_and_never_reads_back(chosen):
    """Partly held tensors (row block, strides, window): the ownership filter runs on the host, so no
    `nonzero` (nor any read-back) on the device; three uploads: positions (int32), values, one table."""
    pieces = _pieces(chosen, 0)
    owned = locate(pieces).positions.numel()
    with OpLog() as log, DeviceLiterals() as literals:
        got = locate(pieces, torch.device("meta"))
    assert got.offsets.device.type == "meta" and got.offsets.numel() == owned and literals.calls == []
    uploads = log.copies("cpu", "meta")
    assert [op.outputs[0].dtype for op in uploads] == [torch.int32, BF16, torch.int64]
    assert all(op.kwargs["non_blocking"] for op in uploads)
    assert uploads[0].outputs[0].numel() == uploads[1].outputs[0].numel() == owned
    assert log.copies("meta", "cpu") == [] and log.host_reads() == []
    assert [op for op in log.named("nonzero") if op.devices() != {"cpu"}] == []
    assert all(op.devices() == {"cpu"} for op in log.ops[: log.ops.index(uploads[0])])  # host ops first


def _stager(applier: DeltaApplier, info) -> Stager:
    """A stager of `info`'s delta on `applier`, with no bound on what it stages."""
    applier.placements  # noqa: B018 - learned (or handed over) before staging
    return Stager(applier.routing, applier.shadows, info.manifest, max_staged_bytes=1 << 40)


def _stage_batch(stager: Stager, deltas) -> None:
    """Locate, digest and stage `deltas` as one batch."""
    for delta in deltas:
        stager.take(delta)
    stager.flush()


def staged_by(tmp_path, cfg, rank: int, tp: int, force: bool, monkeypatch):
    """Prepare a 30% step with digests on one rank (CPU), on the host path or the forced device path."""
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    if not (tmp_path / "d").exists():
        DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg, rank=rank, tp=tp)
    model.load_weights(base.items())
    monkeypatch.setattr(batched, "FORCE_DEVICE_PATH", force)
    return DeltaApplier(model, meta, rank=rank).prepare(
        tmp_path / "d", version=1, base_version=0, current_version=0
    )


@pytest.mark.parametrize(
    "cfg,tp,rank",
    [(DC.SIZES["tiny"], 1, 0), (DC.SIZES["tiny"], 2, 1), (moe(1, 8), 2, 0), (moe(1, 8), 2, 1)],
    ids=["tiny", "tiny-tp2-r1", "moe-tp2-r0", "moe-tp2-r1"],
)
def test_device_path_stages_what_the_host_path_stages(tmp_path, monkeypatch, cfg, tp, rank):
    host = staged_by(tmp_path, cfg, rank, tp, False, monkeypatch)
    dev = staged_by(tmp_path, cfg, rank, tp, True, monkeypatch)
    assert dev.digests == host.digests and any(v[0] and v[1] for v in host.digests.values())
    assert dev.changed == host.changed > 0 and list(dev.writes) == list(host.writes)
    for target, chunks in host.writes.items():
        assert len(dev.writes[target]) == len(chunks), target
        for a, b in zip(chunks, dev.writes[target]):
            assert (
                a.base == b.base and a.offsets.dtype == b.offsets.dtype and torch.equal(a.offsets, b.offsets)
            )
            assert a.values.dtype == b.values.dtype and torch.equal(
                a.values.view(torch.uint8), b.values.view(torch.uint8)
            )


def test_per_destination_work_on_meta_has_no_sync_and_crosses_6_bytes_a_change(tmp_path):
    """The batched staging (locate, current values, ULP resolve, digests) of fused experts at TP=2 on
    meta parameters: no device->host copy, read or device `nonzero`; per change 4 B of positions and
    2 B of values cross (the host path crossed 4 B offsets + 2 B values + 8 B positions, + 8 B slots);
    the pieces' tables cross once per destination, whatever the density."""
    cfg = moe(1, 8)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    tables = []
    for density in (0.2, 0.6):
        DC.write_delta(
            tmp_path / f"d{density}", base, DC.step(base, density, seed=1), version=1
        )  # with digests
        placements = DeltaApplier(DC.SyntheticLM(cfg, rank=1, tp=2), meta).placements
        applier = DeltaApplier(
            DC.SyntheticLM(cfg, rank=1, tp=2, device="meta"), meta, placements=placements, rank=1
        )
        info = open_delta(tmp_path / f"d{density}")
        deltas = list(iter_delta(info, expected=meta, current_version=0))
        stager = _stager(applier, info)
        staging, sums = stager.staging, stager.sums
        with OpLog() as log, DeviceLiterals() as literals:
            _stage_batch(stager, deltas)
        assert literals.calls == []
        assert staging.changed and len(sums.rows) == 2 * len(
            staging.writes
        )  # pre and post summed per destination
        assert log.copies("meta", "cpu") == [] and log.host_reads() == []
        assert [op for op in log.named("nonzero") if op.devices() != {"cpu"}] == []
        uploads = log.copies("cpu", "meta")
        assert all(op.name == "_to_copy" and op.kwargs["non_blocking"] for op in uploads)
        per_change = [op for op in uploads if op.outputs[0].dtype != torch.int64]
        assert sum(op.outputs[0].nbytes for op in per_change) == 6 * staging.changed
        table = [op for op in uploads if op.outputs[0].dtype == torch.int64]
        assert len(table) <= len(staging.writes)
        tables.append(sum(op.outputs[0].nbytes for op in table))
    assert tables[0] == tables[1] > 0


C, R = 1 << 10, (1 << 23) + 2  # R * C = 2^33 + 2C elements: positions only, never a tensor that big
EDGES = [0, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 33) - 1, 1 << 33, R * C - 1]


def test_device_locate_is_exact_past_2_to_the_33_and_narrows_positions_only_below_2_to_the_31():
    """Independent reference: the row-major and transposed formulas. A row block holding the upper
    half (a rank's share) keeps only its positions. Positions cross as int32 only while every
    tensor has < 2^31 elements."""
    pos = torch.tensor(EDGES)
    half = R // 2
    pieces = [
        Piece(0, pos, torch.zeros(len(EDGES), dtype=BF16), Segment("w", (R, C), 0, (C, 1), 0, (C, 1)), R * C),
        Piece(1, pos, torch.zeros(len(EDGES), dtype=BF16), Segment("w", (R, C), 0, (C, 1), 0, (1, R)), R * C),
        Piece(
            2,
            pos,
            torch.zeros(len(EDGES), dtype=BF16),
            Segment("w", (R - half, C), half * C, (C, 1), 7, (C, 1)),
            R * C,
        ),
    ]
    upper = pos[pos >= half * C]
    want = torch.cat([pos, (pos % C) * R + pos // C, upper - half * C + 7])
    for device, there in ((None, None), (torch.device("cpu"), False), (torch.device("cpu"), True)):
        got = locate(pieces, device, there=there)
        assert torch.equal(got.offsets, want) and torch.equal(got.positions, torch.cat([pos, pos, upper]))
    for numel, width in [((1 << 31) - 1, torch.int32), (1 << 31, torch.int64)]:
        small = [
            Piece(
                0,
                torch.tensor([0, numel - 1]),
                torch.zeros(2, dtype=BF16),
                Segment("w", (numel,), 0, (1,), 5, (1,)),
                numel,
            )
        ]
        with OpLog() as log:
            got = locate(small, torch.device("meta"))
        assert [op.outputs[0].dtype for op in log.copies("cpu", "meta")] == [width, BF16]
        assert torch.equal(locate(small, torch.device("cpu")).offsets, torch.tensor([5, numel + 4]))


def test_device_path_ops_per_destination_do_not_grow_with_the_experts_behind_it(tmp_path):
    """TP=2 rank 1 on meta (row and column splits of every expert): 8x the expert tensors, the same ops."""

    def ops(experts: int) -> tuple[int, int]:
        cfg = moe(1, experts)
        meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
        base = DC.random_checkpoint(cfg, "cpu", seed=0)
        DC.write_delta(tmp_path / f"e{experts}", base, DC.step(base, 0.5, seed=1), version=1)
        placements = DeltaApplier(DC.SyntheticLM(cfg, rank=1, tp=2), meta).placements
        applier = DeltaApplier(
            DC.SyntheticLM(cfg, rank=1, tp=2, device="meta"), meta, placements=placements, rank=1
        )
        info = open_delta(tmp_path / f"e{experts}")
        deltas = list(iter_delta(info, expected=meta, current_version=0))
        stager = _stager(applier, info)
        staging = stager.staging
        with OpCount() as count:
            _stage_batch(stager, deltas)
        return count.count, len(staging.writes)

    few, many = ops(4), ops(32)
    assert few == many, (few, many)
