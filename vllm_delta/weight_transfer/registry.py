"""Our backend in vLLM's two weight-transfer registries (by module path: nothing of ours is imported until
used), from the general plugin, which vLLM loads in every process. Who holds which name: backend_names.py."""

from __future__ import annotations

import functools
import logging

from vllm_delta import settings
from vllm_delta.backend_names import ALIAS, BACKEND, holder, is_ours, package_of

logger = logging.getLogger("vllm.delta_updates")

WORKER = ("vllm_delta.weight_transfer.worker_engine", "DeltaWeightTransferEngine")
TRAINER = ("vllm_delta.weight_transfer.trainer", "DeltaTrainerWeightTransferEngine")


class BackendNameTaken(RuntimeError):
    """Another installed package registered `vllm_delta`: pairing with it would be silent and wrong."""


def register_backends() -> None:
    """Both registries; idempotent, as plugins may load more than once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as Engines
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as Trainers

    for factory, (module, cls) in ((Engines, WORKER), (Trainers, TRAINER)):
        for name in (BACKEND, ALIAS):
            held = holder(factory._registry, name)
            if held is None:
                factory.register_engine(name, module, cls)
            elif held != module and name == BACKEND:
                raise BackendNameTaken(
                    f"vLLM's weight-transfer backend {BACKEND!r} is already registered by "
                    f"{package_of(held)}; vllm-delta will not share the name (a trainer and an engine "
                    "could then pair with different backends). Uninstall one of the two packages."
                )
            elif held != module:
                why = "weight-transfer backend %r belongs to %s; vllm-delta answers to %r only"
                logger.info(why, name, package_of(held), BACKEND)


def observe_post_load_steps() -> None:
    """Observe post-load steps (engine/transforms) with our route on, or in engines whose weight-transfer
    backend is ours: decided when the step runs, under the worker's config; stock vLLM otherwise."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.model_loader import base_loader

    from vllm_delta.engine import transforms

    if getattr(base_loader.process_weights_after_loading, "_delta_wrapped", False):
        return
    stock = base_loader.process_weights_after_loading
    transforms.install()
    if settings.updates_enabled():  # set by --enable-delta-updates before the workers start
        return
    keeping = base_loader.process_weights_after_loading

    @functools.wraps(stock)
    def process(model, model_config, target_device) -> None:
        transfer = getattr(get_current_vllm_config_or_none(), "weight_transfer_config", None)
        ours = transfer is not None and is_ours(transfer.backend)  # the config the model loads under
        (keeping if ours else stock)(model, model_config, target_device)

    process._delta_wrapped = True  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process
