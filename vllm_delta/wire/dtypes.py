"""The dtypes a delta can carry, and the same-width integer views the codecs move bit patterns in
(unsigned in numpy, whose unsigned arithmetic wraps; signed in torch, which has few unsigned ops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import UnknownDtypeError

TorchDType = torch.dtype  # `DType.torch` hides the module inside the class body


@dataclass(frozen=True)
class DType:
    name: str  # the name written to manifests and flush metadata
    st_code: str  # the safetensors header code
    torch: TorchDType
    int_view: TorchDType  # signed torch integer of the same width
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize

    @property
    def uint(self) -> np.dtype:
        """Little-endian unsigned numpy dtype of the same width."""
        return np.dtype(f"<u{self.itemsize}")


_ALL = [
    DType("float64", "F64", torch.float64, torch.int64, True),
    DType("float32", "F32", torch.float32, torch.int32, True),
    DType("bfloat16", "BF16", torch.bfloat16, torch.int16, True),
    DType("float16", "F16", torch.float16, torch.int16, True),
    DType("float8_e4m3fn", "F8_E4M3", torch.float8_e4m3fn, torch.int8, True),
    DType("float8_e5m2", "F8_E5M2", torch.float8_e5m2, torch.int8, True),
    DType("int64", "I64", torch.int64, torch.int64, False),
    DType("int32", "I32", torch.int32, torch.int32, False),
    DType("int16", "I16", torch.int16, torch.int16, False),
    DType("int8", "I8", torch.int8, torch.int8, False),
    DType("uint8", "U8", torch.uint8, torch.int8, False),
]
_BY_NAME = {d.name: d for d in _ALL}
_BY_TORCH = {d.torch: d for d in _ALL}
_BY_ST = {d.st_code: d for d in _ALL}


def by_name(name: str, *, file: str | None = None, param: str | None = None) -> DType:
    """Look up a manifest dtype name; the seed's `torch.bfloat16` spelling is accepted too."""
    d = _BY_NAME.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if d is None:
        raise UnknownDtypeError(f"unknown dtype {name!r}", file=file, param=param)
    return d


def by_torch(dtype: torch.dtype) -> DType:
    d = _BY_TORCH.get(dtype)
    if d is None:
        raise UnknownDtypeError(f"unsupported dtype {dtype}")
    return d


def by_st_code(code: str, *, file: str | None = None) -> DType:
    d = _BY_ST.get(code)
    if d is None:
        raise UnknownDtypeError(f"unknown safetensors dtype {code!r}", file=file)
    return d


def to_bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view of a CPU tensor's bit patterns (no copy when contiguous)."""
    d = by_torch(t.dtype)
    return t.detach().reshape(-1).view(d.int_view).numpy().view(d.uint)


def from_bits(bits: np.ndarray, d: DType) -> torch.Tensor:
    """Tensor of dtype `d` holding `bits` (a flat unsigned array of the same width)."""
    signed = np.ascontiguousarray(bits).view(f"<i{d.itemsize}")
    return torch.from_numpy(signed).view(d.torch)
