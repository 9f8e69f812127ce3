"""The decorator of every kernel: numba's `njit(nogil=True)`, cached on disk where numba can write, else
(a read-only install with no writable home, where `cache=True` raises at import) compiled per process."""

from __future__ import annotations

from collections.abc import Callable

from numba import njit


def kernel(fn: Callable) -> Callable:
    """`fn` compiled by numba on first call (per signature), releasing the GIL while it runs."""
    try:
        return njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True)(fn)
