"""Test-only: MLA engines whose post-load steps make derived tensors copies, or derive one no re-run
reproduces.

Why: on vLLM's CPU MLA backend with a bf16 `kv_b_proj`, `W_UV` / `W_UK_T` are views of
`kv_b_proj.weight`, so in-place deltas reach them whether or not the receiver re-derives them.
AMX, a quantized `kv_b_proj` and DCP make them real copies. Importing this module (in the engines'
workers only: `worker_extension_cls=` one of the extensions below) patches vLLM's classes:

- `MLAAttention.process_weights_after_loading` on the layers under `COPIED`: after vLLM's own step,
  `W_UV` and `W_UK_T` become new Parameters holding copies (as AMX / a dequantized `kv_b_proj`
  make them), so decode reads only the copies; the other layers keep vLLM's views;
- with `MODEL_STEP_ENV` set, the model gets a model-level step (as a model plugin may) that
  derives `MODEL_TENSOR` by accumulating into it: a re-run does not reproduce it, so the engine
  must refuse updates at startup, naming it.
"""

from __future__ import annotations

import os

import torch

from vllm_delta.engine import derived
from vllm_delta.engine.worker import DeltaWorkerExtension

EXTENSION = "harness.post_load_steps_mla_worker.MlaStepsWorkerExtension"
COPIED = "model.layers.0."  # the dense layer's MLA keeps copies; layer 1's (MoE) keeps vLLM's views
MODEL_STEP_ENV = "DELTA_TEST_MODEL_STEP"
MODEL_TENSOR = "lm_head_sum"
STEP_CALLS = [0]  # MLA post-load steps run in this worker (the patched step counts itself)


def _patch() -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.model_executor.utils import replace_parameter

    stock = MLAAttention.process_weights_after_loading

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        STEP_CALLS[0] += 1
        stock(self, act_dtype)
        if self.layer_name.startswith(COPIED) and hasattr(self, "W_UV"):  # (AMX keeps its own packed copies)
            for name in ("W_UV", "W_UK_T"):
                replace_parameter(self, name, getattr(self, name).detach().clone())  # a new Parameter, a copy

    MLAAttention.process_weights_after_loading = process_weights_after_loading

    if os.environ.get(MODEL_STEP_ENV):

        def model_step(self) -> None:
            w = self.lm_head.weight.detach().float()
            prev = getattr(self, MODEL_TENSOR, None)
            setattr(self, MODEL_TENSOR, w if prev is None else prev + w)  # depends on its own last value

        DeepseekV2ForCausalLM.process_weights_after_loading = model_step


_patch()


class MlaStepsWorkerExtension(DeltaWorkerExtension):
    """The delta worker extension, in a worker whose MLA layers under `COPIED` keep copies."""

    def mla_discovery(self) -> dict:
        """What `derived` found at startup: tensors (unit, key, kind, sources), units, refusals."""
        found = derived.discovery(self.model_runner.get_model())
        return {
            "tensors": [(t.unit, t.key, t.kind, t.sources) for t in found.tensors],
            "units": {u.name: sorted(u.sources) for u in found.units if u.kind == "rederive"},
            "refused": found.refused,
        }

    def mla_pointers(self) -> dict[str, int]:
        """data_ptr() of every parameter and every derived tensor (CUDA-graph safety)."""
        model = self.model_runner.get_model()
        out = {f"param:{n}": p.data_ptr() for n, p in model.named_parameters()}
        for t in derived.discovery(model).tensors:
            out[f"derived:{t.unit}.{t.key}"] = derived.reach(model.get_submodule(t.unit))[t.key][3].data_ptr()
        return out

    def mla_commit_logged(self, request_id: str) -> dict:
        """`delta_commit`, with the ops it dispatched that wrote into (or viewed) a re-derived tensor
        (harness/dispatch_log.OpLog) and how many MLA post-load steps ran during it."""
        from harness.dispatch_log import OpLog
        from vllm_delta.engine.intercept import storage_key

        model = self.model_runner.get_model()
        storages = {
            storage_key(derived.reach(model.get_submodule(t.unit))[t.key][3])
            for t in derived.discovery(model).tensors
            if t.kind == "rederive"
        }
        steps = STEP_CALLS[0]
        with OpLog() as log:
            reply = self.delta_commit(request_id)
        touching = [
            op.name for op in log.ops if any(t.numel() and storage_key(t) in storages for t in op.outputs)
        ]
        return {"reply": reply, "ops": touching, "steps": STEP_CALLS[0] - steps}

    def mla_prepare_failing(self, request: dict) -> dict:
        """`delta_prepare` failing right after the post-load work was built on stand-ins (the last thing a
        prepare does before it replies): a fault injected into this worker only."""
        from vllm_delta.engine import commit

        built = commit.prebuild_touched

        def then_fail(*args, **kwargs):
            built(*args, **kwargs)
            raise ValueError("injected: the prepare fails after its prebuild")

        commit.prebuild_touched = then_fail
        try:
            return self.delta_prepare(request)
        finally:
            commit.prebuild_touched = built

    def mla_derived_digests(self) -> dict[str, str]:
        """xxh3 of every derived tensor's bits (what prefill and decode read besides the parameters)."""
        from vllm_delta.wire import tensor_digest

        model = self.model_runner.get_model()
        return {
            f"{t.unit}.{t.key}": tensor_digest(derived.reach(model.get_submodule(t.unit))[t.key][3])
            for t in derived.discovery(model).tensors
        }
