"""`vllm.general_plugins` entry point, loaded in every vLLM process (front end, engine core, workers)."""

import os

from vllm_delta.engine.cpu_amx import request_amx_permission

ENABLED_ENV = "VLLM_DELTA_UPDATES"


def delta_updates_enabled() -> bool:
    return os.environ.get(ENABLED_ENV) == "1"


def register() -> None:
    """Prepare this vLLM process; CPU weight bookkeeping only when delta updates are on."""
    request_amx_permission()
    if not delta_updates_enabled():
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_delta.engine import cpu_weights

        cpu_weights.install()
