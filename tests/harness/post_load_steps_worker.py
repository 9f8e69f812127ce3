"""Test-only: real engines whose post-load steps permute one weight and derive a tensor from another.

Why: vLLM's CPU kernels keep every weight in place on this machine, so the permutation and
derived-tensor branches of `vllm_delta.engine.transforms` would never run on a real engine.
Engines started with `worker_extension_cls=post_load_steps.EXTENSION` (this module's
`DeltaWorkerExtension`, imported by every worker before it loads the model; the patch happens on
that import, so no other process is touched) get two post-load steps, by layer prefix, in vLLM's
own `UnquantizedLinearMethod`, and one in vLLM's own unquantized fused MoE:

- `PERMUTED` (layer 0's qkv_proj): swaps the halves of its (local) weight rows, as
  FlashInfer-CUTLASS MoE swaps w13; the forward swaps the output halves back;
- `DERIVED` (layer 1's o_proj): derives a float32 transposed copy `W_T`, like MLA's `W_UV`
  from `kv_b_proj`, and the forward uses only `W_T`, so a stale copy changes the output;
- `MOE_PERMUTED` (layer 0's fused experts): the kernel-format conversion that vLLM's
  `UnquantizedFusedMoEMethod` runs (`convert_to_unquantized_kernel_format`) swaps the w13 halves
  with vLLM's own `swap_w13_to_w31`, as for FlashInfer-CUTLASS, on its first call and on each
  weight update (copied into the existing storage); the experts keep that layout (no CPU prepack)
  and their forward is the torch reference (harness/torch_moe) on the halves swapped back.

Each is what the served output depends on: a delta written to the wrong half, or a derived
tensor not re-derived, changes greedy tokens and logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.post_load_steps import DERIVED, MOE_PERMUTED, PERMUTED
from vllm_delta.engine import transforms
from vllm_delta.engine.stand_in import held_tensors
from vllm_delta.engine.worker import DeltaWorkerExtension


def _which(layer: torch.nn.Module) -> str | None:
    prefix = getattr(layer, "prefix", "")
    return next((s for s in (PERMUTED, DERIVED) if prefix.endswith(s)), None)


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[0] // 2
    return torch.cat([t[half:], t[:half]]).contiguous()


def _patch() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    stock_step, stock_apply = (
        UnquantizedLinearMethod.process_weights_after_loading,
        UnquantizedLinearMethod.apply,
    )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        which = _which(layer)
        if which == PERMUTED:
            layer.weight.data = _swap_halves(layer.weight.data)
        elif which == DERIVED:
            layer.W_T = layer.weight.detach().float().t().contiguous()
        else:
            stock_step(self, layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        which = _which(layer)
        if which == PERMUTED:
            out = F.linear(x, layer.weight)
            rows = layer.weight.shape[0]
            out = torch.cat([out[..., rows - rows // 2 :], out[..., : rows - rows // 2]], dim=-1)
        elif which == DERIVED:
            out = (x.float() @ layer.W_T).to(x.dtype)
        else:
            return stock_apply(self, layer, x, bias)
        return out if bias is None else out + bias

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    UnquantizedLinearMethod.apply = apply


def _patch_moe() -> None:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.experts import (
        cpu_moe,
    )  # on EP engines torch_moe patches it first
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31

    from harness.torch_moe.moe_reference import reference_moe

    def swapped(layer: torch.nn.Module | None) -> bool:
        return getattr(layer, "layer_name", "").endswith(MOE_PERMUTED)

    stock_convert = method.convert_to_unquantized_kernel_format

    def convert_to_unquantized_kernel_format(backend, moe_config, w13_weight, w2_weight, layer=None):
        w13, w2 = stock_convert(
            backend, moe_config=moe_config, w13_weight=w13_weight, w2_weight=w2_weight, layer=layer
        )
        return (swap_w13_to_w31(w13) if swapped(layer) else w13), w2

    experts = cpu_moe.CPUUnquantizedExperts
    stock_step, stock_apply = experts.process_weights_after_loading, experts.apply

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if swapped(layer):
            self._use_zentorch, self._delta_swapped = False, True  # keep the swapped layout: apply reads it
        else:
            stock_step(self, layer)

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
        if getattr(self, "_delta_swapped", False):
            reference_moe(
                output,
                hidden_states,
                swap_w13_to_w31(w1),
                w2,
                topk_weights,
                topk_ids,
                activation,
                expert_map,
                apply_router_weight_on_input,
            )
        else:
            stock_apply(
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
            )

    method.convert_to_unquantized_kernel_format = convert_to_unquantized_kernel_format
    experts.process_weights_after_loading = process_weights_after_loading
    experts.apply = apply


_patch()
_patch_moe()


class StepsWorkerExtension(DeltaWorkerExtension):
    """The delta worker extension, in a worker whose two test layers have the steps above."""

    def steps_transforms(self) -> dict[str, str]:
        """{module: kind} as the engine classified its post-load steps at start."""
        return transforms.transformed(self.model_runner.get_model())

    def steps_pointers(self) -> dict[str, int]:
        """data_ptr() of every non-empty tensor each module holds (parameters, buffers, tensor attributes
        such as the derived `W_T`): updates must write in place (captured CUDA graphs keep reading the
        storage they were captured with)."""
        model = self.model_runner.get_model()
        return {
            f"{name}.{key}": t.data_ptr()
            for name, m in model.named_modules()
            for key, (_, _, t) in held_tensors(m).items()
            if t.numel()
        }

    def steps_maps(self) -> dict[str, dict]:
        """{param: its permutation map's form and size, and the params its module's step changed}."""
        model = self.model_runner.get_model()

        def transform(name: str):
            return getattr(model.get_submodule(name.rsplit(".", 1)[0]), transforms.TRANSFORM_ATTR)

        return {
            name: {
                "row_len": m.row_len,
                "nbytes": m.table.nbytes,
                "numel": m.numel,
                "changed": transform(name).changed,
            }
            for name, m in transforms.offset_maps(model).items()
        }
