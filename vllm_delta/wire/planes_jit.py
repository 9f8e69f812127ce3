"""`ulp_zstd`'s position and value streams of a block, each built in one pass (numba), for the sender.

Why: the numpy codecs (`codecs.encode_gaps` + `to_planes`, `ulp_steps` + `encode_steps`, the
references these are tested byte-equal to) make about ten passes over a block's changes (gaps,
their narrowing, byte columns, two order keys, steps, signs, flags, magnitudes, escapes), plus a
param-wide int64 temporary for the gap width: most of a 10 M-change encode that is not zstd. Here
each stream is written as the changes are read once.

numba is optional (the `cpu-scan` extra): without it, for dtypes other than 1-, 2- and 4-byte floats
(their order key is the one written here), or with `VLLM_DELTA_ENCODE_KERNEL=0`, the numpy codecs run.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from . import codecs
from .dtypes import DType

HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def enabled() -> bool:
    """numba importable and not switched off by the environment."""
    return HAVE_NUMBA and os.environ.get("VLLM_DELTA_ENCODE_KERNEL", "1") != "0"


def gap_width(pos: np.ndarray, prev: int = -1) -> int:
    """`codecs.gap_width`: the narrowest width of the largest gap, without an int64 temporary."""
    if not (enabled() and pos.size > 1 and pos.dtype == np.int64):
        return codecs.gap_width(pos, prev=prev)
    from ._planes_kernels import max_gap

    return codecs._narrowest(int(max_gap(pos, prev)))


def gap_planes(pos: np.ndarray, *, prev: int = -1, width: int | None = None) -> tuple[int, list[bytes]]:
    """(width, byte planes) as `codecs.encode_gaps` then `codecs.to_planes` give them."""
    if not (enabled() and pos.size and pos.dtype == np.int64):
        w, gaps = codecs.encode_gaps(pos, prev=prev, width=width)
        return w, codecs.to_planes(gaps)
    from ._planes_kernels import write_gap_planes

    w = gap_width(pos, prev) if width is None else width
    out = np.empty((w, pos.size), np.uint8)
    write_gap_planes(pos, prev, out)
    return w, [bytes(memoryview(row)) for row in out]


def ulp_streams(new: np.ndarray, old: np.ndarray, d: DType) -> dict[str, bytes]:
    """`sign`, `flag` and `esc0..` as `codecs.encode_steps(codecs.ulp_steps(new, old, d), d)` give them."""
    if not (enabled() and d.is_float and d.itemsize in (1, 2, 4) and new.size
            and new.dtype == d.uint and old.dtype == d.uint):
        sign, flag, esc = codecs.encode_steps(codecs.ulp_steps(new, old, d), d)
        return {"sign": sign, "flag": flag, **{f"esc{j}": p for j, p in enumerate(codecs.to_planes(esc))}}
    from ._planes_kernels import write_ulp_streams

    n = new.size
    sign, flag = np.zeros(codecs.bits_len(n), np.uint8), np.zeros(codecs.bits_len(n), np.uint8)
    esc = np.empty((d.itemsize, n), np.uint8)
    count = write_ulp_streams(new, old, sign, flag, esc)
    out = {"sign": bytes(memoryview(sign)), "flag": bytes(memoryview(flag))}
    out.update({f"esc{j}": bytes(memoryview(esc[j, :count])) for j in range(d.itemsize)})
    return out
