"""What an engine serves for its fp8 linear layers, read inside the worker (`/collective_rpc` `fp8_served`).

Why: the test states, on the real engine, what vLLM's CPU block-fp8 post-load step did to each
layer's weight and scale, so a vLLM upgrade that changes it fails there instead of going unseen.
`install()` (run in an fp8 engine's processes by `harness/fp8_engine_site`) adds `fp8_served` to the
worker extension when its module is imported, as `harness/commit_fault.py` arms its fault, so a
`vllm serve` answers it through vLLM's dev-mode `/collective_rpc`. Bytes travel as `digest`s (JSON).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import sys
from typing import Any

import torch

WORKER = "vllm_delta.engine.worker"


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as laid out in memory, row-major."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()


def sorted_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in sorted order: equal for any permutation of the same bytes."""
    return digest(t.detach().contiguous().view(torch.uint8).reshape(-1).sort().values)


def served_fp8(worker) -> dict[str, dict]:
    """{module: its fp8 layer's classes, transform, live pointers, and the live / checkpoint-layout bytes'
    digests}."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_delta.engine import transforms

    model = worker.model_runner.get_model()
    out = {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
            continue
        t = getattr(module, transforms.TRANSFORM_ATTR, None)
        unit = transforms.rerun_unit(module)
        stash = unit.canonical if unit is not None else {}
        weight, scale = module.weight, module.weight_scale_inv
        out[name] = {
            "kernel": type(module.quant_method.fp8_linear).__name__,
            "weight_class": type(weight).__name__,
            "scale_class": type(scale).__name__,
            "kind": t and t.kind,
            "changed": t and t.changed,
            "pointers": [weight.data_ptr(), scale.data_ptr()],  # what a captured graph reads
            "live_weight": digest(weight),
            "live_weight_sorted": sorted_digest(weight),
            "live_scale": digest(scale),
            "canonical_weight": digest(stash["weight"]) if "weight" in stash else None,
        }
    return out


class _AddOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; adds `fp8_served` to the worker extension right after its module loads."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != WORKER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_add(module: Any) -> None:
            exec_module(module)
            module.DeltaWorkerExtension.fp8_served = served_fp8

        spec.loader.exec_module = exec_and_add
        return spec


def install() -> None:
    sys.meta_path.insert(0, _AddOnImport())
