"""What an engine serves for its fp8 linear layers, read inside the worker (`llm.collective_rpc(served_fp8)`).

Why: the test states, on the real engine, what vLLM's CPU block-fp8 post-load step did to each
layer's weight and scale, so a vLLM upgrade that changes it fails there instead of going unseen.
Bytes are returned whole (the model is tiny), for the test to compare with the checkpoint's.
"""

from __future__ import annotations

import torch


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def served_fp8(worker) -> dict[str, dict]:
    """{module: its fp8 layer's classes, transform, and the live / checkpoint-layout bytes}."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_delta.engine import canonical_weights, transforms

    model = worker.model_runner.get_model()
    out = {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
            continue
        t = getattr(module, transforms.TRANSFORM_ATTR, None)
        stash = getattr(module, canonical_weights.STASH_ATTR, {})
        weight, scale = module.weight, module.weight_scale_inv
        out[name] = {
            "kernel": type(module.quant_method.fp8_linear).__name__,
            "weight_class": type(weight).__name__,
            "scale_class": type(scale).__name__,
            "weight_layout": (tuple(weight.shape), weight.stride(), str(weight.dtype)),
            "kind": t and t.kind,
            "changed": t and t.changed,
            "derived": t and t.derived,
            "live_weight": _bytes(weight),
            "live_scale": _bytes(scale),
            "canonical_weight": _bytes(stash["weight"]) if "weight" in stash else None,
        }
    return out
