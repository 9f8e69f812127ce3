"""Test-only: how many signatures each compiled kernel holds in this process, to show that a sync
compiled nothing (the startup probe's `warm_up` had). `KernelSignatures` is a worker extension
(`EXTENSION`) that reads it in an engine's worker, through vLLM's `collective_rpc`."""

from __future__ import annotations

import importlib

MODULES = ("digest_jit", "params_jit", "scan_jit", "scatter_jit", "ulp_jit")
EXTENSION = "harness.kernel_signatures.KernelSignatures"


def signatures() -> dict[str, int]:
    """Per kernel (`module.name`), the signatures numba compiled or loaded from its cache so far."""
    out = {}
    for m in MODULES:
        module = importlib.import_module(f"vllm_delta.kernels.{m}")
        for name, obj in vars(module).items():
            if hasattr(obj, "signatures") and getattr(obj, "__module__", None) == module.__name__:
                out[f"{m}.{name}"] = len(obj.signatures)
    return out


class KernelSignatures:
    """Mixed into vLLM's worker class; `collective_rpc("kernel_signatures")` answers per worker."""

    def kernel_signatures(self) -> dict[str, int]:
        return signatures()
