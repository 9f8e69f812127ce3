"""`vllm.general_plugins` entry point, loaded in every vLLM process (front end, engine core, workers)."""

import os

from vllm_delta.engine.cli_args import ENV_FLAG
from vllm_delta.engine.cpu_amx import request_amx_permission


def register() -> None:
    """Prepare this vLLM process; post-load transform bookkeeping only when delta updates are on."""
    request_amx_permission()
    from vllm_delta.native.registry import keep_cpu_weights_when_configured, register_backends

    register_backends()  # the `delta` weight-transfer backend (vLLM's own RL API)
    if os.environ.get(ENV_FLAG) != "1":  # set by --enable-delta-updates before workers start
        keep_cpu_weights_when_configured()  # only for engines whose weight-transfer backend is `delta`
        return
    from vllm_delta.engine import transforms

    transforms.install()  # observe every module's post-load step (any platform)
