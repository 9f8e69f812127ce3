"""`codecs.decode_gaps`' compiled pass (kernels/gaps_jit.py) against its numpy code
(`VLLM_DELTA_KERNELS=0`): the same positions for every gap width and `prev`, and the same
error for each way a hostile stream can be wrong (a gap past the tensor, a bad `prev`, a last
position past the end, a sum that wraps int64)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_delta.kernels import switch
from vllm_delta.wire import codecs
from vllm_delta.wire.errors import BoundsError

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")


def both(monkeypatch, gaps: np.ndarray, numel: int, prev: int = -1):
    """(kernel's result, numpy's result): each the positions or the BoundsError's message."""
    out = []
    for kernels_on in ("1", "0"):
        monkeypatch.setenv("VLLM_DELTA_KERNELS", kernels_on)
        try:
            out.append(codecs.decode_gaps(gaps, numel, prev=prev, file="f", param="p"))
        except BoundsError as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("width", codecs.GAP_WIDTHS)
@pytest.mark.parametrize("prev", [-1, 0, 1000])
def test_positions_equal_numpy(monkeypatch, width, prev):
    rng = np.random.default_rng(width)
    pos = np.unique(rng.integers(prev + 1, prev + 1 + 200_000, 5000))
    w, gaps = codecs.encode_gaps(pos, prev=prev, width=width if width > 2 else None)
    got, want = both(monkeypatch, gaps, prev + 300_000, prev)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64
    assert np.array_equal(got, want) and np.array_equal(got, pos)


@pytest.mark.parametrize("case", ["gap", "prev", "prev_low", "last", "wrap", "one"])
def test_errors_equal_numpy(monkeypatch, case):
    u8 = np.dtype("<u8")
    gaps, numel, prev = {
        "gap": (np.array([0, 5, 10], np.uint8), 10, -1),  # a gap == numel
        "prev": (np.array([0], np.uint8), 10, 10),
        "prev_low": (np.array([0], np.uint8), 10, -2),
        "last": (np.array([3, 3, 3], np.uint16), 10, -1),  # 3, 7, 11: past the end
        "wrap": (np.array([(1 << 62) - 2] * 4 + [0], u8), (1 << 62) - 1, -1),  # wraps back below numel
        "one": (np.array([9], np.uint32), 10, -1),  # the last element: fine
    }[case]
    got, want = both(monkeypatch, gaps, numel, prev)
    if case == "one":
        assert np.array_equal(got, want) and list(got) == [9]
    else:
        assert isinstance(want, str) and got == want, (got, want)
