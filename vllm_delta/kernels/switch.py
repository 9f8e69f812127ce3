"""The one switch of every compiled kernel: numba importable, and not turned off by
`VLLM_DELTA_KERNELS=0` (`settings.kernels_on`: A/B runs, tests, a CPU numba cannot compile for)."""

from __future__ import annotations

import importlib.util

from vllm_delta import settings

HAVE_NUMBA = importlib.util.find_spec("numba") is not None  # the `cpu-scan` extra (and a vLLM dependency)


def on() -> bool:
    """Whether the compiled kernels run (the environment is read on every call)."""
    return HAVE_NUMBA and settings.kernels_on()
