"""Test-only: vLLM's own CPU block-fp8 kernel, let through its AMX gate on CPUs without AMX tiles.

Why: vLLM 0.32's CPU build serves block-fp8 checkpoints only through `CPUFp8BlockScaledMMKernel`
(W8A16), whose `is_supported` refuses any CPU without AMX tiles; with no other CPU block-fp8
kernel, vLLM then refuses the model, and the fp8 engine tests could not run on this AMD EPYC host
(nor on a CI host like it). Its ops do run without AMX: `convert_weight_packed` VNNI-packs the
weight and `fp8_scaled_mm_cpu` multiplies through its AVX-512 paths. So the stand-in is that very
class with one change, its gate: `is_supported` asks instead whether, on this CPU, the op computes
vLLM's own torch reference of a block-fp8 matmul (`scaled_dequantize`, the inverse of vLLM's
`scaled_quantize`, then a float32 matmul) to within bf16 rounding. Nothing else is replaced: the
weights, loaders, post-load step (the VNNI pack our `transforms` re-runs, the scale re-wrap), the
matmul and our delta apply are vLLM's and ours. On a CPU with AMX nothing is added and vLLM picks
its kernel unchanged.

Tests start such engines with `harness.fp8_engine`, whose site runs `install()` in every process
of the engine; the fresh loader's child calls it too.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

TARGET = "vllm.model_executor.kernels.linear"
STAND_IN = "NoAmxCPUFp8BlockScaledMMKernel"
VLLM_KERNEL = "CPUFp8BlockScaledMMKernel"


def served_kernel() -> str:
    """The class name vLLM picks for a block-fp8 linear layer on this CPU."""
    import torch

    return VLLM_KERNEL if torch.cpu._is_amx_tile_supported() else STAND_IN


@functools.cache
def _op_matches_reference() -> tuple[bool, str | None]:
    """Whether `fp8_scaled_mm_cpu` on a VNNI-packed weight computes vLLM's torch reference here, for one
    row (its per-row path) and for 16 rows (its bf16 BRGEMM path)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_dequantize

    f32 = {"dtype": torch.float32, "device": "cpu"}  # explicit: vLLM sets bf16 as default while it builds
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 384, generator=gen, **f32) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen, **f32) / 100 + 1e-3
    packed = torch.ops._C.convert_weight_packed(weight)
    dense = scaled_dequantize(weight, scale, group_shape=GroupShape(128, 128))
    for rows in (1, 16):
        x = torch.randn(rows, 384, generator=gen, **f32).to(torch.bfloat16)
        out = torch.ops._C.fp8_scaled_mm_cpu(x, packed, scale, [128, 128], None, torch.bfloat16, True)
        ref = x.float() @ dense.t()
        err = float((out.float() - ref).abs().max())
        if not err <= 2**-7 * float(ref.abs().max()):
            return False, f"fp8_scaled_mm_cpu differs from vLLM's torch reference on this CPU ({rows} rows)."
    return True, None


def _add_stand_in(module: Any) -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        return  # vLLM's own kernel serves it
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.platforms import PlatformEnum, current_platform

    class NoAmxCPUFp8BlockScaledMMKernel(CPUFp8BlockScaledMMKernel):
        """`CPUFp8BlockScaledMMKernel` with its AMX gate replaced by a check of its op (module docstring)."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            if not current_platform.is_cpu():
                return False, "requires CPU platform."
            return _op_matches_reference()

    kernels = module._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == STAND_IN for k in kernels):
        kernels.append(NoAmxCPUFp8BlockScaledMMKernel)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; adds the stand-in right after vLLM's kernel registry is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_add(module: Any) -> None:
            exec_module(module)
            _add_stand_in(module)

        spec.loader.exec_module = exec_and_add
        return spec


def install() -> None:
    """Add the stand-in in this process: now if vLLM's kernel registry is imported, else at its import."""
    if TARGET in sys.modules:
        _add_stand_in(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
