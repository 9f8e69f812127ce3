"""The decorator of every kernel: numba's `njit(nogil=True)`, cached on disk where numba can write.

numba caches a compiled kernel beside its source (`__pycache__`), else under the user's cache
directory (or `NUMBA_CACHE_DIR`). Where none of them is writable (a read-only install in a
container without a writable home), `cache=True` makes the decorator itself raise, so importing a
kernel would fail; there the kernel is compiled each process instead (`warmup.warm_up` at startup).
"""

from __future__ import annotations

from collections.abc import Callable

from numba import njit


def kernel(fn: Callable) -> Callable:
    """`fn` compiled by numba on first call (per signature), releasing the GIL while it runs."""
    try:
        return njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True)(fn)
