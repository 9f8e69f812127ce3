"""The one-pass ULP stream builder (`codecs.ulp_streams`: kernels/ulp_jit.py) writes exactly the numpy
codecs' bytes.

The numpy codecs (`codecs.encode_gaps` + `to_planes`, `codecs.encode_steps(ulp_steps(...))`) are
the reference: they are what the wire goldens were made with. Cases: every float width, counts
around a packed byte's edge, steps of every class (0, +-1, escapes, the most negative step, every
sign and NaN pattern), and the fallback where the kernel does not apply.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_delta.kernels import switch
from vllm_delta.wire import codecs
from vllm_delta.wire.dtypes import by_name

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba (the cpu-scan extra) not installed")


def _numpy_ulp(new: np.ndarray, old: np.ndarray, d) -> dict[str, bytes]:
    sign, flag, esc = codecs.encode_steps(codecs.ulp_steps(new, old, d), d)
    return {"sign": sign, "flag": flag, **{f"esc{j}": p for j, p in enumerate(codecs.to_planes(esc))}}


def _steps_case(d, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    bits = 8 * d.itemsize
    old = rng.integers(0, 1 << bits, n, dtype=np.uint64)
    step = rng.integers(-3, 4, n).astype(np.int64)  # 0, +-1 (one bit each) and small escapes
    step[::5] = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), step[::5].size)  # large escapes
    new = (old.astype(np.int64) + step).astype(np.uint64)
    edge = [0, 1 << (bits - 1), (1 << bits) - 1, (1 << (bits - 1)) - 1, 1, (1 << (bits - 1)) + 1]
    for k, (a, b) in enumerate([(x, y) for x in edge for y in edge][:n]):  # +-0, NaN/inf-like, extremes
        old[k], new[k] = a, b
    mask = np.uint64((1 << bits) - 1)
    return (new & mask).astype(d.uint), (old & mask).astype(d.uint)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 63, 1000, 4099])
def test_ulp_streams_equal_the_numpy_codecs(dtype: str, n: int) -> None:
    d = by_name(dtype)
    new, old = _steps_case(d, n, seed=n)
    assert codecs.ulp_streams(new, old, d) == _numpy_ulp(new, old, d)


def test_the_most_negative_step_and_every_step_class_are_coded_as_numpy_does() -> None:
    d = by_name("bfloat16")
    old = np.array([0x0000, 0x0000, 0x8000, 0x3F80, 0x3F80, 0x7FFF, 0x0000, 0x0001], dtype=np.uint16)
    # order keys: +0 -> 0x8000, -0 -> 0x7FFF, 0xFFFF -> 0: 0x0000 to 0xFFFF is a step of exactly -2^15
    new = np.array([0x8000, 0x0001, 0x0000, 0x3F81, 0x3F7E, 0xFFFF, 0xFFFF, 0x0000], dtype=np.uint16)
    steps = codecs.ulp_steps(new, old, d).view(np.int16)
    assert (steps == -(1 << 15)).any() and (np.abs(steps.astype(np.int32)) > 1).any()
    assert codecs.ulp_streams(new, old, d) == _numpy_ulp(new, old, d)


def test_where_the_kernel_does_not_apply_the_numpy_codecs_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer dtypes and the environment's switch take the numpy codecs."""
    rng = np.random.default_rng(0)
    d = by_name("int16")
    new, old = rng.integers(0, 1 << 16, 50, dtype=np.uint16), rng.integers(0, 1 << 16, 50, dtype=np.uint16)
    assert codecs.ulp_streams(new, old, d) == _numpy_ulp(new, old, d)
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert not switch.on()
    f = by_name("bfloat16")
    assert codecs.ulp_streams(new, old, f) == _numpy_ulp(new, old, f)
