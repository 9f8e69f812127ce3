"""The one switch of every compiled kernel (numba importable, not turned off by `VLLM_DELTA_KERNELS=0`:
A/B runs, tests, a CPU numba cannot compile for) and the one decorator of every kernel."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from vllm_delta import settings

HAVE_NUMBA = importlib.util.find_spec("numba") is not None  # the `cpu-scan` extra (and a vLLM dependency)


def on() -> bool:
    """Whether the compiled kernels run (the environment is read on every call)."""
    return HAVE_NUMBA and settings.kernels_on()


def kernel(fn: Callable) -> Callable:
    """`fn` under numba's `njit(nogil=True)`, cached on disk where numba can write, else (a read-only
    install with no writable home, where `cache=True` raises at import) compiled per process."""
    from numba import njit

    try:
        return njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True)(fn)
