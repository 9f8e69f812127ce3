"""A post-load step that deletes the parameters it consumed: vLLM's KV-cache scale method.

Why: every fp8 checkpoint gives its attention layers vLLM's `BaseKVCacheMethod` (`Fp8KVCacheMethod`),
whose post-load step folds `k_scale`, `v_scale`, `q_scale` and `prob_scale` into `_k_scale`...
and deletes them. The observer took a deleted parameter for a permutation candidate and failed
with a KeyError, so the engine refused to start. Here vLLM's own method runs on a module laid out
as its Attention layer holds the scales, for the default KV cache and an fp8 one.
"""

from __future__ import annotations

import pytest
import torch
from harness.synthetic import vllm_loop
from torch import nn

from vllm_delta.engine import transforms

SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")


class ScaledAttention(nn.Module):
    """The scale state vLLM's `Attention.__init__` gives a layer, with vLLM's KV-cache method on it."""

    def __init__(self, kv_cache_dtype: str) -> None:
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        super().__init__()
        self.kv_cache_dtype = kv_cache_dtype
        for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu"):
            setattr(self, n, torch.tensor(1.0))
        self._k_scale_float = self._v_scale_float = self._q_scale_float = self._prob_scale_float = 1.0
        self.quant_method = BaseKVCacheMethod(None)
        self.quant_method.create_weights(self)


def _model(kv_cache_dtype: str, k: float, v: float) -> nn.Module:
    model = nn.Module()
    model.attn = ScaledAttention(kv_cache_dtype)
    with torch.no_grad():
        model.attn.k_scale.fill_(k)
        model.attn.v_scale.fill_(v)
    return model


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_step_that_deletes_its_scales_is_served_by_rerunning_it(kv_cache_dtype):
    model = _model(kv_cache_dtype, 0.5, 0.25)
    assert vllm_loop(model) == {"attn": "rerun"}
    assert sorted(getattr(model.attn, transforms.TRANSFORM_ATTR).changed) == sorted(SCALES)
    # A delta to k_scale lands in the tensor the placement sees, and the step derives from it again.
    live, canonical = transforms.canonical_tensors(model)["attn.k_scale"]
    canonical.fill_(0.125)
    transforms.rerun_unit(model.attn).rederive()
    fresh = _model(kv_cache_dtype, 0.125, 0.25)
    vllm_loop(fresh)
    for n in ("_k_scale", "_v_scale", "_q_scale", "_k_scale_cpu", "_v_scale_cpu"):
        assert torch.equal(getattr(model.attn, n), getattr(fresh.attn, n)), n
    assert model.attn._k_scale_float == fresh.attn._k_scale_float
    assert sorted(n for n, _ in model.attn.named_parameters()) == sorted(SCALES)  # still placeable
