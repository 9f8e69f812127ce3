"""Position and value codecs on numpy arrays (and the receiver's ULP resolve in torch): positions are
sorted unique int64 flat indices, values bit patterns as unsigned integers; every decoder validates what
it returns. Gaps: d[k] = idx[k] - idx[k-1] - 1, idx[-1] = -1. Byte plane j: byte j of every entry."""

from __future__ import annotations

import numpy as np
import torch

from vllm_delta.kernels import switch

from .dtypes import DType, by_torch
from .errors import BoundsError, FormatError

GAP_WIDTHS = (1, 2, 4, 8)
_MAX_NUMEL = 1 << 62  # keeps every gap term and prefix sum inside int64


def check_numel(numel: int, *, param: str | None = None) -> None:
    if not 0 <= numel < _MAX_NUMEL:
        raise FormatError(f"tensor of {numel} elements is out of range", param=param)


def check_positions(pos: np.ndarray, numel: int, *, file: str | None, param: str | None) -> None:
    """Positions must lie in [0, numel) and increase strictly (no duplicates)."""
    if pos.size and (pos[0] < 0 or pos[-1] >= numel):
        raise BoundsError(f"position out of range [0, {numel})", file=file, param=param)
    if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
        raise BoundsError("positions are not strictly increasing", file=file, param=param)


def _uint(width: int) -> np.dtype:
    return np.dtype(f"<u{width}")


def _frombuffer(buf: memoryview, dtype: np.dtype, count: int, what: str, *, file, param) -> np.ndarray:
    if len(buf) != count * dtype.itemsize:
        raise BoundsError(
            f"{what}: {len(buf)} bytes for {count} entries of {dtype.itemsize} B", file=file, param=param
        )
    return np.frombuffer(buf, dtype=dtype, count=count)


def encode_gaps(pos: np.ndarray, *, prev: int = -1, width: int | None = None) -> tuple[int, np.ndarray]:
    """Gaps in the narrowest unsigned width that holds the largest one (or in `width`); `prev`: the position
    before `pos[0]` (-1 at a param's start: a block continues its param's gaps)."""
    pos = pos.astype(np.int64, copy=False)
    gaps = np.empty(pos.size, dtype=np.int64)  # np.diff(pos, prepend=prev) - 1, in two passes instead of four
    if pos.size:
        gaps[0] = pos[0] - prev - 1
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[1:] -= 1
    if width is None:
        width = _narrowest(int(gaps.max()) if gaps.size else 0)
    return width, gaps.astype(_uint(width))


def _narrowest(top: int) -> int:
    """The narrowest gap width that holds `top`."""
    return next(w for w in GAP_WIDTHS if top < 1 << (8 * w))


def gap_width(pos: np.ndarray, *, prev: int = -1) -> int:
    """The width `encode_gaps` picks, from the largest gap alone."""
    if not pos.size:
        return GAP_WIDTHS[0]
    top = int(pos[0]) - prev - 1
    if pos.size > 1:
        top = max(top, int(np.subtract(pos[1:], pos[:-1], dtype=np.int64).max()) - 1)
    return _narrowest(top)


def decode_gaps(gaps: np.ndarray, numel: int, *, prev: int = -1, file, param) -> np.ndarray:
    """Prefix-sum gaps back to positions: every gap is checked below numel (< 2^62) first, so a wrap in
    the prefix sum would show as a decrease, which `check_positions` rejects."""
    if gaps.size == 0:
        return np.zeros(0, dtype=np.int64)
    if int(gaps.max()) >= numel or not -1 <= prev < numel:
        raise BoundsError(f"gap exceeds the tensor's {numel} elements", file=file, param=param)
    pos = np.cumsum(gaps.astype(np.int64) + 1)
    pos += prev
    check_positions(pos, numel, file=file, param=param)
    return pos


def to_planes(arr: np.ndarray) -> list[bytes]:
    w = arr.dtype.itemsize
    grid = arr.astype(arr.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w)
    # a contiguous copy of each column first: 3x faster than tobytes() of the strided column
    return [bytes(np.ascontiguousarray(grid[:, j]).data) for j in range(w)]


def from_planes(planes: list[memoryview], count: int, width: int, what: str, *, file, param) -> np.ndarray:
    grid = np.empty((count, width), dtype=np.uint8)
    for j, plane in enumerate(planes):
        grid[:, j] = _frombuffer(
            plane, np.dtype(np.uint8), count, f"{what} plane {j}", file=file, param=param
        )
    return grid.view(_uint(width)).reshape(count)


def _int(d: DType) -> np.dtype:
    return np.dtype(f"<i{d.itemsize}")


def _key(b, d: DType, *, inverse: bool = False):
    """The order key of bit patterns `b` viewed as same-width signed integers (numpy or torch: `>>`
    is arithmetic in both, and their wrapping adds equal the unsigned ones), or with `inverse` the
    bits of a key. Floats: negatives are bit-flipped, positives get the sign bit set (-0 and +0 are
    neighbours). Signed ints: flip the sign bit. Unsigned: identity. All bijections, so 1 ULP is a
    step of 1."""
    top = 8 * d.itemsize - 1
    sign = -(1 << top)  # the sign bit as a signed integer of this width
    if d.name == "uint8":
        return b
    if not d.is_float:
        return b ^ sign
    return b ^ (((~b if inverse else b) >> top) | sign)


def order_key(bits: np.ndarray, d: DType) -> np.ndarray:
    """Map bit patterns to unsigned keys that sort like the values (`_key`)."""
    return _key(bits.view(_int(d)), d).view(d.uint)


def from_order_key(key: np.ndarray, d: DType) -> np.ndarray:
    return _key(key.view(_int(d)), d, inverse=True).view(d.uint)


def ulp_steps(new_bits: np.ndarray, old_bits: np.ndarray, d: DType) -> np.ndarray:
    """Wrapping step (key_new - key_old) mod 2^bits, as unsigned."""
    return order_key(new_bits, d) - order_key(old_bits, d)


def ulp_resolve(old_bits: np.ndarray, steps: np.ndarray, d: DType) -> np.ndarray:
    return from_order_key(order_key(old_bits, d) + steps, d)


def ulp_resolve_tensor(old: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`ulp_resolve` in torch integer ops where `old` lives (a GPU's weights never cross to the host);
    `steps` are same-width signed integers on `old`'s device."""
    d = by_torch(old.dtype)
    if steps.device != old.device or steps.numel() != old.numel() or steps.element_size() != d.itemsize:
        raise ValueError(
            f"{steps.numel()} {steps.dtype} steps on {steps.device} for "
            f"{old.numel()} {old.dtype} values on {old.device}"
        )
    key = _key(old.reshape(-1).view(d.int_view), d) + steps.reshape(-1).view(d.int_view)
    return _key(key, d, inverse=True).view(d.torch)


def encode_steps(steps: np.ndarray, d: DType) -> tuple[bytes, bytes, np.ndarray]:
    """Split steps into packed sign bits, packed `|step| > 1` flags and escapes `|step| - 2` (about 9 in
    10 Adam-step changes move one ULP, so escapes are rare)."""
    signed = steps.view(_int(d))
    neg = signed < 0  # the sign bit
    mag = np.abs(signed).view(d.uint)  # 0 - step where negative; the most negative maps to itself, as there
    big = mag > 1
    return np.packbits(neg).tobytes(), np.packbits(big).tobytes(), mag[big] - d.uint.type(2)


def ulp_streams(new: np.ndarray, old: np.ndarray, d: DType) -> dict[str, bytes]:
    """`sign`, `flag` and `esc0..` as `encode_steps(ulp_steps(new, old, d), d)` give them, in one compiled
    pass (kernels/ulp_jit.py) for 1-, 2- and 4-byte floats where the kernels are on (numpy: ~10 passes)."""
    if not (
        switch.on()
        and d.is_float
        and d.itemsize in (1, 2, 4)
        and new.size
        and new.dtype == d.uint
        and old.dtype == d.uint
    ):
        sign, flag, esc = encode_steps(ulp_steps(new, old, d), d)
        return {"sign": sign, "flag": flag, **{f"esc{j}": p for j, p in enumerate(to_planes(esc))}}
    from vllm_delta.kernels.ulp_jit import write_ulp_streams

    n = new.size
    signs, flags = np.zeros((n + 7) // 8, np.uint8), np.zeros((n + 7) // 8, np.uint8)
    esc = np.empty((d.itemsize, n), np.uint8)
    count = write_ulp_streams(new, old, signs, flags, esc)
    out = {"sign": bytes(signs.data), "flag": bytes(flags.data)}
    out.update({f"esc{j}": bytes(esc[j, :count].data) for j in range(d.itemsize)})
    return out
