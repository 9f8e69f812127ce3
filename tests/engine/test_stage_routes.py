"""Staging asks nothing per checkpoint tensor that depends only on the placements: each tensor's route
(replayed, batched or masked) and its landings are worked out once per ownership.

Why: at 44k tensors every method call a tensor is a measured share of prepare's fixed cost
(docs/results/scale.md, "Prepare per-tensor cost (session 7, after the reader and staging work)").
So the calls are COUNTED (never timed): none on a second sync; a new ownership (the route hands one
over at startup) is worked out again, since it decides which tensors batch.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from harness.synthetic import device_check

from vllm_delta.engine import routing
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import Ownership
from vllm_delta.wire import iter_delta, open_delta
from vllm_delta.wire.deltas import DeltaBatch

DC = device_check()
BF16 = torch.bfloat16
from test_batched_apply import moe  # noqa: E402

# Python calls into the package a tensor when staging a decoded batch a second time (measured: 0).
STAGE_CALLS_PER_TENSOR = 0
# Lines run in the package a tensor, the same way (session 9; measured: 0, was 16 before it).
STAGE_LINES_PER_TENSOR = 0


def _one_moe_layer_delta(tmp_path):
    """A one-layer, 8-expert synthetic model, its applier, the opened delta of half its elements, its meta."""
    cfg = moe(1, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.5, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    info = open_delta(tmp_path / "d")
    return model, applier, info, meta


def test_routes_are_worked_out_once_per_ownership(tmp_path, monkeypatch):
    model, applier, info, meta = _one_moe_layer_delta(tmp_path)
    deltas = list(iter_delta(info, expected=meta, current_version=0))
    first = applier.stage(info.manifest, deltas, version=1, replay=False, start=0.0)
    calls = {"_route": 0}
    for name in calls:

        def counted(*args, _name=name, _real=getattr(applier.routing, name)):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(applier.routing, name, counted)
    again = applier.stage(info.manifest, deltas, version=1, replay=False, start=0.0)
    assert calls == {"_route": 0}
    assert again.digests == first.digests and again.changed == first.changed > 0
    routes = applier.routing.routes()
    assert all(r.kind == routing.BATCH for r in routes.values()) and len(routes) == len(deltas)
    # A new ownership: a tensor a lower rank now holds is masked, the others still batch.
    held = next(iter(routes))
    ownership = Ownership()
    ownership.lower = {held: [object()]}
    applier.ownership = ownership
    now = applier.routing.routes()
    assert now[held].kind == routing.MASKED and [r.kind for n, r in now.items() if n != held] == [
        routing.BATCH
    ] * (len(now) - 1)
    assert calls["_route"] == len(now)


def _staging_calls(
    tmp_path, experts: int, lines: bool = False
) -> tuple[int, collections.Counter, object, object]:
    """Stage one delta read in batches (as prepare reads it) a second time, counting Python calls into
    the package by (module, function), or with `lines` the lines it runs there (a Python loop's body is
    one a pass): (tensors, counts, the first sync's result, the second's)."""
    cfg = moe(1, experts)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / f"d{experts}", base, DC.step(base, 0.5, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    info = open_delta(tmp_path / f"d{experts}")
    items = list(iter_delta(info, expected=meta, current_version=0, batches=True))
    assert {type(i) for i in items} == {DeltaBatch}  # the batched decoder took every tensor
    first = applier.stage(info.manifest, items, version=1, replay=False, start=0.0)  # plans, routes: once
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and "vllm_delta" in frame.f_code.co_filename:
            calls[(Path(frame.f_code.co_filename).name, frame.f_code.co_name)] += 1

    def trace(frame, event, arg):
        if "vllm_delta" not in frame.f_code.co_filename:
            return None
        if event == "line":
            calls[(Path(frame.f_code.co_filename).name, frame.f_code.co_name, frame.f_lineno)] += 1
        return trace

    (sys.settrace if lines else sys.setprofile)(trace if lines else profile)
    try:
        again = applier.stage(info.manifest, items, version=1, replay=False, start=0.0)
    finally:
        (sys.settrace if lines else sys.setprofile)(None)
    return sum(len(i) for i in items), calls, first, again


def test_staging_a_decoded_batch_makes_no_call_a_tensor(tmp_path):
    """A decoded batch is staged whole: the Python calls of a second sync do not grow with the tensors
    (8 -> 24 experts: 3 tensors more an expert, the same 2 fused destinations a layer)."""
    small, a, first, again = _staging_calls(tmp_path, 8)
    large, b, _, _ = _staging_calls(tmp_path, 24)
    assert large > small
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b)}
    assert sum(grew.values()) <= STAGE_CALLS_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g)
    assert again.digests == first.digests and again.changed == first.changed > 0


def test_staging_a_decoded_batch_runs_no_line_a_tensor(tmp_path):
    """Nor a Python loop a tensor: the lines staging runs in the package do not grow with the tensors (its
    per-tensor work is C-level passes over columns; docs/results/scale.md, "... (session 9)")."""
    small, a, _, _ = _staging_calls(tmp_path, 8, lines=True)
    large, b, _, _ = _staging_calls(tmp_path, 24, lines=True)
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b)}
    assert sum(grew.values()) <= STAGE_LINES_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g)


def test_a_batch_stages_what_its_tensors_stage_one_at_a_time(tmp_path):
    """The same writes (offsets and values, bit for bit), digests and counts from a decoded batch as from
    its tensors' ParamDeltas."""
    cfg = moe(2, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    info = open_delta(tmp_path / "d")
    staged = []
    for batches in (False, True):
        items = list(iter_delta(info, expected=meta, current_version=0, batches=batches))
        staged.append(
            DeltaApplier(model, meta).stage(info.manifest, items, version=1, replay=False, start=0.0)
        )
    one, whole = staged
    assert (whole.digests, whole.changed, whole.total_changed, whole.blocks, whole.expected, whole.after) == (
        one.digests,
        one.changed,
        one.total_changed,
        one.blocks,
        one.expected,
        one.after,
    )
    assert list(whole.writes) == list(one.writes) and one.changed > 0
    for target, chunks in one.writes.items():
        a, b = (torch.cat([c.offsets for c in cs]) for cs in (chunks, whole.writes[target]))
        va, vb = (
            torch.cat([c.values.view(torch.int16) for c in cs]) for cs in (chunks, whole.writes[target])
        )
        order_a, order_b = a.argsort(), b.argsort()
        assert torch.equal(a[order_a], b[order_b]) and torch.equal(va[order_a], vb[order_b]), target


def test_a_plans_destinations_are_worked_out_once(tmp_path, monkeypatch):
    """What locate makes of a plan's pieces alone (what holds for all of them, their per-piece numbers) is
    kept with the plan: COUNTED, none of it on a second sync, which stages the same writes and digests."""
    from vllm_delta.engine import batched

    model, applier, info, meta = _one_moe_layer_delta(tmp_path)
    items = list(iter_delta(info, expected=meta, current_version=0, batches=True))
    calls = collections.Counter()
    for name in ("_kinds", "_number"):

        def counted(*args, _name=name, _real=getattr(batched, name)):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(batched, name, counted)
    first = applier.stage(info.manifest, items, version=1, replay=False, start=0.0)
    assert calls["_kinds"] > 0 and calls["_number"] > 0
    calls.clear()
    again = applier.stage(info.manifest, items, version=1, replay=False, start=0.0)
    assert calls == {}
    fresh = DeltaApplier(model, meta).stage(info.manifest, items, version=1, replay=False, start=0.0)
    for staged in (again, fresh):
        assert (staged.digests, staged.changed) == (first.digests, first.changed) and first.changed > 0
        assert list(staged.writes) == list(first.writes)
        for target, chunks in first.writes.items():
            for a, b in zip(chunks, staged.writes[target]):
                assert torch.equal(a.offsets, b.offsets) and torch.equal(
                    a.values.view(torch.int16), b.values.view(torch.int16)
                )
