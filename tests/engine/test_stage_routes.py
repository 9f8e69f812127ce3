"""Staging asks nothing per checkpoint tensor that depends only on the placements: each tensor's route
(replayed, batched or masked) and its landings are worked out once per ownership.

Why: at 44k tensors every method call a tensor is a measured share of prepare's fixed cost
(docs/results/scale.md, "Prepare per-tensor cost (session 7, after the reader and staging work)").
So the calls are COUNTED (never timed): none on a second sync; a new ownership (the route hands one
over at startup) is worked out again, since it decides which tensors batch.
"""

from __future__ import annotations

import torch

from harness.synthetic import device_check
from vllm_delta.engine import apply
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import Ownership
from vllm_delta.wire import iter_delta, open_delta

DC = device_check()
BF16 = torch.bfloat16
from test_batched_apply import moe  # noqa: E402


def test_routes_are_worked_out_once_per_ownership(tmp_path, monkeypatch):
    cfg = moe(1, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.5, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    info = open_delta(tmp_path / "d")
    deltas = list(iter_delta(info, expected=meta, current_version=0))
    first = applier.stage(info.manifest, deltas, version=1, replay=False, start=0.0)
    calls = {"_batchable": 0, "_landings": 0}
    for name in calls:
        def counted(*args, _name=name, _real=getattr(applier, name)):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(applier, name, counted)
    again = applier.stage(info.manifest, deltas, version=1, replay=False, start=0.0)
    assert calls == {"_batchable": 0, "_landings": 0}
    assert again.digests == first.digests and again.changed == first.changed > 0
    routes = applier._routes()
    assert all(kind == apply._BATCH for kind, _ in routes.values()) and len(routes) == len(deltas)
    # A new ownership: a tensor a lower rank now holds is masked, the others still batch.
    held = next(iter(routes))
    ownership = Ownership()
    ownership.lower = {held: [object()]}
    applier.ownership = ownership
    now = applier._routes()
    assert now[held][0] == apply._MASKED and [k for n, (k, _) in now.items() if n != held] == [apply._BATCH] * (len(now) - 1)
    assert calls["_batchable"] == len(now) and calls["_landings"] == len(now)
