"""The one switch of every compiled kernel: numba importable and not turned off by the environment.

`VLLM_DELTA_KERNELS=0` runs the numpy/torch references everywhere (A/B runs, tests, a CPU numba
cannot compile for). The per-area names of earlier releases (`VLLM_DELTA_APPLY_KERNEL`,
`VLLM_DELTA_SCAN_KERNEL`, `VLLM_DELTA_ENCODE_KERNEL`) still work, as aliases that turn off all of them.
"""

from __future__ import annotations

import importlib.util
import os

HAVE_NUMBA = importlib.util.find_spec("numba") is not None  # the `cpu-scan` extra (and a vLLM dependency)
VARS = ("VLLM_DELTA_KERNELS", "VLLM_DELTA_APPLY_KERNEL", "VLLM_DELTA_SCAN_KERNEL", "VLLM_DELTA_ENCODE_KERNEL")


def on() -> bool:
    """Whether the compiled kernels run (read on every call: tests and benchmarks flip it)."""
    return HAVE_NUMBA and all(os.environ.get(v, "1") != "0" for v in VARS)
