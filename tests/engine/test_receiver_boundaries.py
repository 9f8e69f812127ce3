"""Index widths on the receiver at 2^31, 2^32 and 2^33 elements, with no real memory.

Why: a staged offset narrowed to int32, or a width check that lets int32 through up to 2^32
elements, wraps silently: the scatter writes a wrong slot and nothing complains. The product
narrows offsets to int32 below 2^31 storage elements, so the tests sit on both sides of it:
- a huge checkpoint tensor (`meta` probe) loaded in small windows into CPU parameters, as a TP
  rank of a large embedding is: probe, decode, locate, digest and commit run for real, with
  checkpoint positions past 2^31, 2^32 and 2^33, against values computed from the positions;
- parameters on `meta` whose storage has more than 2^31 (or 2^33) elements, or a small view at
  storage offset 2^31: the staged offsets (host tensors) are checked exactly, and the commit runs
  through on `meta`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from harness.dispatch_log import OpLog
from torch import nn

from vllm_delta.engine import apply, stager
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import (
    Ownership,
    check_coverage,
    check_partials,
    contains,
    lattice,
    segment_chunks,
)
from vllm_delta.engine.placement import Segment, TensorPlacement, owned_by_tensor
from vllm_delta.wire import ENCODINGS, DeltaWriter, load_manifest, write_manifest
from vllm_delta.wire.additive import partial_sum, to_hex

BF16 = torch.bfloat16
C = 1 << 10  # columns
R = (1 << 23) + 2  # rows: R * C = 2^33 + 2C elements (16 GiB of bf16, never allocated)
NUMEL = R * C
NAME = "big.weight"
CHECKPOINT = {NAME: ((R, C), BF16)}
EDGES = [(1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 33) - 1, 1 << 33, NUMEL - 1]

# name: (first of its two checkpoint rows, what the loader does to those rows)
View = Callable[[torch.Tensor], torch.Tensor]
WINDOWS: dict[str, tuple[int, View]] = {
    "rows31": ((1 << 31) // C - 1, lambda w: w),  # the two rows around position 2^31
    "rows32": ((1 << 32) // C - 1, lambda w: w),
    "rows33": ((1 << 33) // C - 1, lambda w: w),
    "last": (R - 2, lambda w: w),
    "strided32": ((1 << 32) // C - 1, lambda w: w[:, 0:16:2]),  # every other column: an ownership mask
    "transposed32": ((1 << 32) // C, lambda w: w.t()),  # other strides on each side
}


def owned_ranges(placement: TensorPlacement) -> list[tuple[int, int]] | None:
    return owned_by_tensor({placement.name: placement})[placement.name]


def values(positions: torch.Tensor, version: int) -> torch.Tensor:
    """Values as a function of the flat position (so no 2^33-element tensor exists)."""
    raw = (positions * 2654435761 + version * 40503) % 2039 - 1019
    return (raw.to(torch.float32) / 4096).to(BF16)


def base(positions: torch.Tensor) -> torch.Tensor:
    """The checkpoint at version 0."""
    return values(positions, 0)


def new(positions: torch.Tensor) -> torch.Tensor:
    """The checkpoint at version 1: version 0 with `changed_positions()` moved."""
    out = values(positions, 0)
    moved = torch.isin(positions, changed_positions())
    out[moved] = values(positions[moved], 1)
    return out


def rows(first: int, checkpoint: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Two whole checkpoint rows from `first`: what the loader's `narrow` would read."""
    return checkpoint(torch.arange(first * C, (first + 2) * C)).view(2, C)


class WindowedModule(nn.Module):
    """Small CPU parameters, each holding a view of two rows of one huge checkpoint tensor."""

    def __init__(self) -> None:
        super().__init__()
        for name, (_, view) in WINDOWS.items():
            shape = view(torch.empty(2, C, device="meta")).shape
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=BF16), requires_grad=False))

    def load_weights(self, weights) -> None:
        for _, w in weights:
            for name, (first, view) in WINDOWS.items():
                getattr(self, name).data.copy_(view(w.narrow(0, first, 2)))


def reference(checkpoint: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each parameter holds after a full load: the loader's views, of the rows it reads."""
    return {name: view(rows(first, checkpoint)).contiguous() for name, (first, view) in WINDOWS.items()}


def loaded(checkpoint: Callable[[torch.Tensor], torch.Tensor]) -> WindowedModule:
    m = WindowedModule()
    for name, t in reference(checkpoint).items():
        getattr(m, name).data.copy_(t)
    return m


def held_positions() -> torch.Tensor:
    """Every checkpoint position some window holds, sorted (the views' ids, computed by hand)."""
    ids = [
        view(torch.arange(first * C, (first + 2) * C).view(2, C)).reshape(-1)
        for first, view in WINDOWS.values()
    ]
    return torch.cat(ids).unique()


@functools.cache
def changed_positions() -> torch.Tensor:
    """Changed positions: the edges, a third of the held ones, and some that no window holds."""
    held = held_positions()
    unheld = torch.tensor([5, (1 << 31) + 3 * C, (1 << 32) + 5 * C + 1, (1 << 33) - 7 * C])
    positions = torch.cat([torch.tensor(EDGES), held[::3], unheld]).unique()
    return positions[values(positions, 0).view(torch.int16) != values(positions, 1).view(torch.int16)]


def write_delta(path, encoding: str) -> None:
    """The delta from `base` to `new`, with the pre/post digests this rank's partial must give:
    those of the changed positions it holds (other ranks would hold the rest)."""
    positions = changed_positions()
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding) as w:
        w.add(NAME, positions, new(positions), base(positions), shape=(R, C))
    mine = positions[torch.isin(positions, held_positions())]
    update = dict(
        pre_digest=to_hex(partial_sum(mine, base(mine))), post_digest=to_hex(partial_sum(mine, new(mine)))
    )
    manifest = load_manifest(path)
    write_manifest(
        path, manifest.model_copy(update={"params": [p.model_copy(update=update) for p in manifest.params]})
    )


def test_the_probe_learns_segments_past_2_to_the_33():
    placement = DeltaApplier(WindowedModule(), CHECKPOINT).placements[NAME]
    assert placement.fallback_reason is None
    by_target = {s.target: s for s in placement.segments}
    for name, (first, _) in WINDOWS.items():
        assert by_target[name].src_offset == first * C, name
    assert by_target["strided32"].src_strides == (C, 2)
    assert by_target["transposed32"].dst_strides == (1, 2)
    assert by_target["last"].src_last == NUMEL - 1
    ranges = owned_ranges(placement)
    assert ranges[0] == (WINDOWS["rows31"][0] * C, (WINDOWS["rows31"][0] + 2) * C - 1)
    assert ranges[-1] == (WINDOWS["rows33"][0] * C, NUMEL - 1)  # rows33 and last meet: one range


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_apply_past_2_to_the_33_equals_the_values_at_those_positions(tmp_path, encoding):
    write_delta(tmp_path / "d", encoding)
    model = loaded(base)
    applier = DeltaApplier(model, CHECKPOINT)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    assert check_partials([{"digests": staged.digests, "expected": staged.expected}]) == 2
    applier.commit(staged)
    want = reference(new)
    for name, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), want[name].view(torch.int16)), name


def test_digests_and_ownership_past_2_to_the_33():
    model = loaded(base)
    applier = DeltaApplier(model, CHECKPOINT)
    placement = applier.placements[NAME]
    # The full-verify partial: every held element once, at its true position.
    held = held_positions()
    assert applier.whole_partial(NAME) == to_hex(partial_sum(held, base(held)))
    seg = next(s for s in placement.segments if s.target == "strided32")
    pos, vals = zip(*segment_chunks(seg, torch.zeros(1 << 10, dtype=BF16), max_elements=4))
    first = WINDOWS["strided32"][0] * C
    want = torch.tensor([first + r * C + c for r in range(2) for c in range(0, 16, 2)])
    assert torch.equal(torch.cat(pos), want)
    # Membership and counted-once masks at the edges: 2^32 + 2 is in the strided lattice, 2^32 + 1 not.
    probe = torch.tensor([(1 << 32) - C, (1 << 32) + 1, 1 << 32, (1 << 32) + 2, (1 << 32) + 16, 1 << 33])
    assert contains(lattice(seg), probe).tolist() == [True, False, True, True, False, False]
    lower = Ownership({NAME: [lattice(seg)]})
    assert lower.counted(NAME, probe).tolist() == [False, True, False, False, True, True]


def test_coverage_across_ranks_past_2_to_the_32():
    """Two row halves cover the tensor; one missing row at 2^32 is named with its exact elements."""
    half = R // 2
    top = [(0, (half, C), (C, 1))]
    bottom = [(half * C, (R - half, C), (C, 1))]
    assert check_coverage([{"coverage": {NAME: top}}, {"coverage": {NAME: bottom}}], {NAME: (R, C)})["ok"]
    gap_row = (1 << 32) // C
    upper = [(0, (gap_row, C), (C, 1))]
    lower = [((gap_row + 1) * C, (R - gap_row - 1, C), (C, 1))]
    report = check_coverage([{"coverage": {NAME: upper}}, {"coverage": {NAME: lower}}], {NAME: (R, C)})
    assert report["errors"][NAME].endswith(f"elements [{1 << 32}, {(1 << 32) + C}) are held by no rank")


# ---- parameters on meta with more than 2^31 storage elements ----------------------------------


def meta_param(
    storage_elements: int, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> nn.Parameter:
    storage = torch.empty(storage_elements, dtype=BF16, device="meta")
    return nn.Parameter(storage.as_strided(shape, strides, offset), requires_grad=False)


def staged_offsets(
    tmp_path, model: nn.Module, checkpoint, placements, positions: dict[str, torch.Tensor], encoding: str
) -> dict[str, torch.Tensor]:
    """Prepare and commit on meta; returns each target's staged storage offsets, in staging order."""
    with DeltaWriter(tmp_path / encoding, version=1, base_version=0, encoding=encoding) as w:
        for name, pos in positions.items():
            w.add(
                name,
                pos,
                values(pos, 1),
                values(pos, 1).view(torch.int16).add(1).view(BF16),
                shape=checkpoint[name][0],
            )
    applier = DeltaApplier(model, checkpoint, _never, placements=placements)
    # Located on the host, so the offsets cross (test_device_locate checks the device path's locate equal to
    # it).
    with (
        OpLog() as prepared,
        mock.patch.object(apply, "on_device", lambda device: False),
        mock.patch.object(stager, "on_device", lambda device: False),
    ):
        staged = applier.prepare(tmp_path / encoding, version=1, base_version=0, current_version=0)
    # Staged on the parameter's device (meta, no values): read the offsets as they crossed to it.
    crossed = [
        op.inputs[0]
        for op in prepared.copies("cpu", "meta")
        if op.inputs[0].dtype in (torch.int32, torch.int64)
    ]
    out = {}
    for target, chunks in staged.writes.items():
        assert all(c.offsets.device.type == "meta" for c in chunks)
        host = [crossed.pop(0) for _ in chunks]
        assert [(h.shape, h.dtype) for h in host] == [(c.offsets.shape, c.offsets.dtype) for c in chunks]
        out[target] = torch.cat(host)
    assert crossed == []
    with OpLog() as log:
        applier.commit(staged)
    assert not any(staged.writes.values())
    for op in log.named("index_copy_"):  # the scatter's index keeps the width too
        flat, index = op.inputs[0], op.inputs[1]
        assert index.dtype == torch.int64 or flat.untyped_storage().nbytes() // flat.element_size() < 1 << 31
    assert sum(op.inputs[1].numel() for op in log.named("index_copy_")) == sum(
        t.numel() for t in out.values()
    )
    return out


def _never(weights) -> None:
    raise AssertionError("the placements are given: the loader must not run")


def whole(
    target: str, shape: tuple[int, ...], dst_offset: int = 0, dst_strides: tuple[int, ...] | None = None
) -> Segment:
    src_strides = (shape[1], 1) if len(shape) == 2 else (1,)
    return Segment(target, shape, 0, src_strides, dst_offset, dst_strides or src_strides)


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_staged_offsets_are_exact_past_2_to_the_33_on_meta(tmp_path, encoding):
    model = nn.Module()
    model.w = meta_param(NUMEL, 0, (R, C), (C, 1))
    model.t = meta_param(NUMEL, 0, (R, C), (1, R))  # stored transposed: offset (p % C) * R + p // C
    checkpoint = {"w.weight": ((R, C), BF16), "t.weight": ((R, C), BF16)}
    placements = {
        "w.weight": TensorPlacement("w.weight", (R, C), BF16, [whole("w", (R, C))]),
        "t.weight": TensorPlacement("t.weight", (R, C), BF16, [whole("t", (R, C), 0, (1, R))]),
    }
    pos = torch.tensor([0, *EDGES])
    got = staged_offsets(
        tmp_path, model, checkpoint, placements, {"w.weight": pos, "t.weight": pos}, encoding
    )
    assert got["w"].dtype == torch.int64 and torch.equal(got["w"], pos)
    assert got["t"].dtype == torch.int64 and torch.equal(got["t"], (pos % C) * R + pos // C)


def test_int32_offsets_only_below_2_to_the_31_storage_elements(tmp_path):
    """The width follows the storage, not the parameter: a small view at storage offset 2^31 needs int64."""
    n = 64
    model = nn.Module()
    model.below = meta_param((1 << 31) - 1, (1 << 31) - 1 - n, (n,), (1,))  # last offset 2^31 - 2
    model.at = meta_param(1 << 31, (1 << 31) - n, (n,), (1,))  # last offset 2^31 - 1
    model.above = meta_param((1 << 31) + n, 1 << 31, (n,), (1,))  # first offset 2^31
    model.far = meta_param((1 << 32) + n, 1 << 32, (n,), (1,))  # first offset 2^32
    checkpoint = {f"{t}.weight": ((n,), BF16) for t in ("below", "at", "above", "far")}
    placements = {
        name: TensorPlacement(
            name,
            (n,),
            BF16,
            [whole(name.split(".")[0], (n,), getattr(model, name.split(".")[0]).storage_offset())],
        )
        for name in checkpoint
    }
    pos = torch.tensor([0, 1, *range(7, n - 2, 7), n - 2, n - 1])
    got = staged_offsets(
        tmp_path, model, checkpoint, placements, {name: pos for name in checkpoint}, "indices"
    )
    for target in ("below", "at", "above", "far"):
        start = getattr(model, target).storage_offset()
        assert torch.equal(got[target].to(torch.int64), pos + start), target
    assert got["above"].dtype == got["far"].dtype == torch.int64
