"""Test-only: real engines whose post-load steps permute one weight and derive a tensor from another.

Why: vLLM's CPU kernels keep every weight in place on this machine, so the permutation and
derived-tensor branches of `vllm_delta.engine.transforms` would never run on a real engine.
Engines started with `worker_extension_cls=post_load_steps.EXTENSION` (this module's
`DeltaWorkerExtension`, imported by every worker before it loads the model; the patch happens on
that import, so no other process is touched) get two post-load steps, by layer prefix, in vLLM's
own `UnquantizedLinearMethod`:

- `PERMUTED` (layer 0's qkv_proj): swaps the halves of its (local) weight rows, as
  FlashInfer-CUTLASS MoE swaps w13; the forward swaps the output halves back;
- `DERIVED` (layer 1's o_proj): derives a float32 transposed copy `W_T`, like MLA's `W_UV`
  from `kv_b_proj`, and the forward uses only `W_T`, so a stale copy changes the output.

Both are what the served output depends on: a delta written to the wrong half, or a derived
tensor not re-derived, changes greedy tokens and logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.post_load_steps import DERIVED, PERMUTED
from vllm_delta.engine import transforms
from vllm_delta.engine.worker import DeltaWorkerExtension


def _which(layer: torch.nn.Module) -> str | None:
    prefix = getattr(layer, "prefix", "")
    return next((s for s in (PERMUTED, DERIVED) if prefix.endswith(s)), None)


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[0] // 2
    return torch.cat([t[half:], t[:half]]).contiguous()


def _patch() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    stock_step, stock_apply = UnquantizedLinearMethod.process_weights_after_loading, UnquantizedLinearMethod.apply

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        which = _which(layer)
        if which == PERMUTED:
            layer.weight.data = _swap_halves(layer.weight.data)
        elif which == DERIVED:
            layer.W_T = layer.weight.detach().float().t().contiguous()
        else:
            stock_step(self, layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        which = _which(layer)
        if which == PERMUTED:
            out = F.linear(x, layer.weight)
            rows = layer.weight.shape[0]
            out = torch.cat([out[..., rows - rows // 2:], out[..., :rows - rows // 2]], dim=-1)
        elif which == DERIVED:
            out = (x.float() @ layer.W_T).to(x.dtype)
        else:
            return stock_apply(self, layer, x, bias)
        return out if bias is None else out + bias

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    UnquantizedLinearMethod.apply = apply


_patch()


class StepsWorkerExtension(DeltaWorkerExtension):
    """The delta worker extension, in a worker whose two test layers have the steps above."""

    def steps_transforms(self) -> dict[str, str]:
        """{module: kind} as the engine classified its post-load steps at start."""
        return transforms.transformed(self.model_runner.get_model())
