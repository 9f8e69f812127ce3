"""The additive digest's one segmented sum (`kernels/digest.py`): the compiled variant equal to the
torch code for every width (1, 2, 4 and 8 bytes: 64-bit keys mix the position), segments in runs,
interleaved, empty or given as one int, across the torch code's CPU slices; each segment equal to
`wire.additive.partial_sum` of its entries; and the one switch with its older names."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from vllm_delta import settings
from vllm_delta.kernels import digest, switch
from vllm_delta.wire.additive import partial_sum

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")
DTYPES = [
    torch.float8_e4m3fn,
    torch.uint8,
    torch.bfloat16,
    torch.int16,
    torch.float32,
    torch.int64,
    torch.float64,
]


def _random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern equally likely (the sign bit set half the time: a sign-extension bug shows)."""
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64) * 2 + 1
    return raw.to({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).view(dtype)


def _both(monkeypatch, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(compiled, torch) `segment_sums` of the same arguments."""
    out = []
    for on in ("1", "0"):
        monkeypatch.setenv("VLLM_DELTA_KERNELS", on)
        out.append(digest.segment_sums(*args))
    return out[0], out[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ["runs", "interleaved", "one"])
def test_compiled_equals_torch(monkeypatch, dtype, order):
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    n = 2 * digest.CPU_SLICE + 17  # slices within a segment and across two, an uneven tail
    positions = torch.randint(0, 1 << 40, (n,), generator=g)
    values = _random(n, dtype, g)
    segs = {
        "runs": torch.randint(0, 5, (n,), generator=g).sort().values,  # segment 5 of 6 empty
        "interleaved": torch.randint(0, 6, (n,), generator=g),
        "one": 4,
    }[order]
    got, want = _both(monkeypatch, positions, values, segs, 6)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape == (6, 2)
    assert torch.equal(got, want)
    for s in range(6):
        keep = segs == s if isinstance(segs, torch.Tensor) else torch.full((n,), s == segs)
        assert torch.equal(got[s], partial_sum(positions[keep], values[keep])), s


@pytest.mark.parametrize("on", ["1", "0"])
def test_sums_do_not_depend_on_slicing_and_empty_inputs(monkeypatch, on):
    """The torch code's CPU slices (and the kernel, which has none) give the sum of one unsliced pass."""
    monkeypatch.setenv("VLLM_DELTA_KERNELS", on)
    g = torch.Generator().manual_seed(3)
    n = 3 * digest.CPU_SLICE + 5
    pos = torch.sort(torch.randint(0, 1 << 30, (n,), generator=g)).values
    vals = torch.randn(n, generator=g).bfloat16()
    got = partial_sum(pos, vals)
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    with mock.patch.object(digest, "CPU_SLICE", 1 << 62):
        assert torch.equal(got, partial_sum(pos, vals))
    monkeypatch.setenv("VLLM_DELTA_KERNELS", on)
    none = torch.zeros(0, dtype=torch.int64)
    assert not digest.segment_sums(none, vals[:0], none, 3).any()
    with pytest.raises(ValueError, match="positions for"):
        digest.segment_sums(pos[:2], vals[:3], 0, 1)


def test_a_segment_out_of_range_raises(monkeypatch):
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "1")
    vals = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        digest.segment_sums(torch.arange(3), vals, torch.tensor([0, 1, 3]), 3)
    with pytest.raises(IndexError):
        digest.segment_sums(torch.arange(3), vals, 3, 3)


def test_meta_and_the_switch(monkeypatch):
    """Off the CPU the torch code runs (meta stays meta); each name of the switch turns the kernels off."""
    out = digest.segment_sums(
        torch.zeros(4, dtype=torch.int64, device="meta"),
        torch.empty(4, dtype=torch.bfloat16, device="meta"),
        0,
        2,
    )
    assert out.device.type == "meta" and out.shape == (2, 2)
    assert switch.on()
    for name in (settings.KERNELS, *settings.KERNELS_ALIASES):
        monkeypatch.setenv(name, "0")
        assert not switch.on()
        monkeypatch.delenv(name)
    assert switch.on()
