"""`codecs.decode_gaps` against hostile streams: the positions for every gap width and `prev`, and a
`BoundsError` for each way a stream can be wrong (a gap past the tensor, a bad `prev`, a last position
past the end, a sum that wraps int64). Its compiled pass was deleted (issue 30): it saved under 1% of
the decode phase (docs/results/kernels.md)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_delta.wire import codecs
from vllm_delta.wire.errors import BoundsError


@pytest.mark.parametrize("width", codecs.GAP_WIDTHS)
@pytest.mark.parametrize("prev", [-1, 0, 1000])
def test_positions_round_trip(width, prev):
    rng = np.random.default_rng(width)
    pos = np.unique(rng.integers(prev + 1, prev + 1 + 200_000, 5000))
    w, gaps = codecs.encode_gaps(pos, prev=prev, width=width if width > 2 else None)
    got = codecs.decode_gaps(gaps, prev + 300_000, prev=prev, file="f", param="p")
    assert got.dtype == np.int64 and np.array_equal(got, pos)


@pytest.mark.parametrize("case", ["gap", "prev", "prev_low", "last", "wrap", "one"])
def test_errors(case):
    u8 = np.dtype("<u8")
    gaps, numel, prev = {
        "gap": (np.array([0, 5, 10], np.uint8), 10, -1),  # a gap == numel
        "prev": (np.array([0], np.uint8), 10, 10),
        "prev_low": (np.array([0], np.uint8), 10, -2),
        "last": (np.array([3, 3, 3], np.uint16), 10, -1),  # 3, 7, 11: past the end
        "wrap": (np.array([(1 << 62) - 2] * 4 + [0], u8), (1 << 62) - 1, -1),  # wraps back below numel
        "one": (np.array([9], np.uint32), 10, -1),  # the last element: fine
    }[case]
    if case == "one":
        assert list(codecs.decode_gaps(gaps, numel, prev=prev, file="f", param="p")) == [9]
    else:
        with pytest.raises(BoundsError):
            codecs.decode_gaps(gaps, numel, prev=prev, file="f", param="p")
