"""Test-only: the textbook fused-MoE forward (silu-gated, [E, 2I, H] / [E, H, I] weights), honouring the
expert map. Used by this directory's `sitecustomize` (EP engines) and by the test-only w13 swap in
`harness.post_load_steps_worker`, which un-swaps the halves before calling it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_moe(
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation,
    expert_map: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> None:
    """Write the experts' weighted sum for each token into `output` (w1 rows: gate, then up)."""
    if activation.value != "silu":
        raise NotImplementedError(f"reference MoE: activation {activation.value}")
    ids = topk_ids.long()
    local = expert_map[ids] if expert_map is not None else ids
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in torch.unique(local[local >= 0]).tolist():
        rows, slot = torch.nonzero(local == e, as_tuple=True)
        x = hidden_states[rows]
        gate_up = x @ w1[e].t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].t()
        weight = 1.0 if apply_router_weight_on_input else topk_weights[rows, slot].float().unsqueeze(1)
        out.index_add_(0, rows, y.float() * weight)
    output.copy_(out.to(output.dtype))
