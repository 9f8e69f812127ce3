"""`megatron_hook.hook.Bindings`: the per-sync check that each segment still views its live weight.

Why: a trainer that rebinds `param.data` after `register()` (offload/onload) left the hook diffing
a dead copy, so nothing was ever shipped again. The real-megatron case is test_hook_rebind.py;
this light test pins the rules on a plain module: moved with the same layout is followed (also a
replaced parameter), another layout or a segment over a copy is refused by name, and a sync where
nothing moved runs no torch op at all (counted with a TorchDispatchMode).
"""

from __future__ import annotations

import pytest
import torch
from harness.dispatch_log import OpCount

from megatron_hook.hook import Bindings, RebindError
from vllm_delta.sender.shards import Segments


def model_and_segments() -> tuple[torch.nn.Module, list[Segments]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    w = m[0].weight.detach().reshape(-1)
    segs = [
        Segments("up.weight", w[:12], (6, 4), ((0, 12),)),  # rows 0..2 of weight
        Segments("gate.weight", w.as_strided((3, 2), (4, 1), 12), (3, 2), ((0, 6),)),  # rows 3..5, cols 0..1
        Segments("norm.weight", m[1].weight.detach().reshape(-1), (6,), ((0, 6),)),
    ]
    return m, segs


def test_a_rebound_weight_is_followed_at_the_same_offsets():
    m, segs = model_and_segments()
    b = Bindings([m], segs)
    with torch.no_grad():
        m[0].weight.data = m[0].weight.data.clone()  # onload into new memory
        m[1].weight = torch.nn.Parameter(m[1].weight.detach().clone())  # or a new parameter
    assert sorted(b.refresh(segs)) == ["0.weight", "1.weight"]
    with torch.no_grad():
        m[0].weight.add_(1.0)
        m[1].weight.mul_(3.0)
    w = m[0].weight.detach()
    assert torch.equal(segs[0].tensor, w.reshape(-1)[:12])
    assert torch.equal(segs[1].tensor, w[3:, :2])
    assert torch.equal(segs[2].tensor, m[1].weight.detach())
    assert b.refresh(segs) == []  # followed once, then nothing moved


def test_nothing_moved_costs_no_torch_op():
    m, segs = model_and_segments()
    b = Bindings([m], segs)
    with OpCount() as ops:
        for _ in range(3):
            assert b.refresh(segs) == []
    assert ops.count == 0


@pytest.mark.parametrize(
    "rebind",
    [
        lambda w: w.data.t().contiguous().t(),  # same values, column-major
        lambda w: w.data.double(),
        lambda w: w.data[:5].clone(),
    ],
)
def test_a_rebind_with_another_layout_is_refused_by_name(rebind):
    m, segs = model_and_segments()
    b = Bindings([m], segs)
    with torch.no_grad():
        m[0].weight.data = rebind(m[0].weight)
    with pytest.raises(RebindError, match=r"0\.weight was rebound"):
        b.refresh(segs)


def test_a_segment_over_a_copy_is_refused_at_registration():
    m, segs = model_and_segments()
    segs[0] = segs[0].with_tensor(segs[0].tensor.clone())
    with pytest.raises(RebindError, match="up.weight: its segment is not a view of any model weight"):
        Bindings([m], segs)
