"""`vllm.general_plugins` entry point, loaded in every vLLM process (front end, engine core, workers)."""

from vllm_delta.engine.cpu_amx import request_amx_permission


def register() -> None:
    """Prepare this vLLM process for delta updates."""
    request_amx_permission()
