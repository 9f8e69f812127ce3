"""Register `delta` in vLLM's two weight-transfer registries, from our `vllm.general_plugins` entry point.

Why from the general plugin: vLLM loads it in every process (front end, engine core, workers)
before any engine is created, so `--weight-transfer-config '{"backend": "delta"}'` and the offline
`LLM(weight_transfer_config=...)` find the backend without a patch. Registration is by module
path, so nothing of ours is imported until the backend is used.
"""

from __future__ import annotations

import functools

BACKEND = "delta"


def register_backends() -> None:
    """Both registries; idempotent, as plugins may load more than once per process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_delta.weight_transfer.worker_engine", "DeltaWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "vllm_delta.weight_transfer.trainer", "DeltaTrainerWeightTransferEngine"
        )


def backend_configured() -> bool:
    """Whether the vLLM config being built or loaded selects the `delta` backend."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return transfer is not None and transfer.backend == BACKEND


def keep_cpu_weights_when_configured() -> None:
    """Observe post-load transforms (engine/transforms) for engines using `delta`, on any platform.

    The plugin cannot see the config when it loads, so the choice is made when the model's
    post-load step runs (the worker loads the model under its config): stock vLLM otherwise.
    """
    from vllm.model_executor.model_loader import base_loader

    from vllm_delta.engine import transforms

    if getattr(base_loader.process_weights_after_loading, "_delta_wrapped", False):
        return
    stock = base_loader.process_weights_after_loading
    transforms.install()
    keeping = base_loader.process_weights_after_loading

    @functools.wraps(stock)
    def process(model, model_config, target_device) -> None:
        (keeping if backend_configured() else stock)(model, model_config, target_device)

    process._delta_wrapped = True  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process
