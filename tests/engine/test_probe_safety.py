"""The placement probe never writes a live tensor, and never records a map it cannot prove.

Each loader here is purpose-built for one hole of the old name-based probe (issue 10, "Why" 4):
an `out=` write, an advanced-index `__setitem__`, in-place arithmetic, a write into a live
buffer, arithmetic that looks like a copy. No engine: the probe only needs `load_weights`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_delta.engine import probe as P
from vllm_delta.engine.batched import Piece, locate
from vllm_delta.engine.placement import Segment
from vllm_delta.engine.probe import PeakRss, build_placement, probe_tensor

N = 8


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class HoleModule(nn.Module):
    """One parameter per loader; every loader but `plain` / `rows` / `via_item` / `contig` must fall back."""

    LOADERS = (
        "plain",
        "rows",
        "via_item",
        "contig",
        "out_add",
        "out_cat",
        "adv_setitem",
        "bool_setitem",
        "add_inplace",
        "zero_then_copy",
        "buffer",
        "probe_mul_",
        "plus_one",
        "flip",
    )

    def __init__(self) -> None:
        super().__init__()
        for name in self.LOADERS:
            self.register_parameter(name, _zeros(N, N))
        self.register_buffer("state", torch.zeros(N, N))
        with torch.no_grad():  # distinct bytes everywhere, so any write shows
            for i, t in enumerate([*self.parameters(), *self.buffers()]):
                t.copy_(torch.randn(N, N, generator=torch.Generator().manual_seed(i)))

    def load_weights(self, weights) -> None:
        for name, w in weights:
            p = getattr(self, name).data
            if name == "plain":
                p.copy_(w)
            elif name == "rows":  # a TP-like slice of a 2N-row checkpoint tensor, transposed
                p.copy_(w.narrow(0, N, N).t())
            elif name == "via_item":  # reads a value (meta has none): the careful pass maps it
                if float(w.reshape(-1)[0].item()) >= 0:
                    p.copy_(w)
            elif name == "contig":  # a copy through a fresh tensor: only values can tell
                p.copy_(w.t().contiguous())
            elif name == "out_add":
                torch.add(w, 0, out=p)
            elif name == "out_cat":
                torch.cat([w[: N // 2], w[N // 2 :]], out=p)
            elif name == "adv_setitem":  # rows 2, 0, 5 (advanced indexing -> index_put_)
                p[torch.tensor([2, 0, 5])] = w[:3]
            elif name == "bool_setitem":
                p[torch.arange(N) % 2 == 0] = w[: N // 2]
            elif name == "add_inplace":
                p.add_(w)
            elif name == "zero_then_copy":
                p.zero_()
                p.copy_(w)
            elif name == "buffer":  # live module state that is not a parameter
                self.state.copy_(w)
                p.copy_(w)
            elif name == "probe_mul_":  # writes the checkpoint tensor, then copies it
                w.mul_(2)
                p.copy_(w)
            elif name == "plus_one":  # looks like a copy with an offset: ids stay in range
                p[:, : N - 1].copy_(w[:, : N - 1] + 1)
            elif name == "flip":
                p.copy_(w.flip(0))


SHAPES = {n: ((2 * N, N) if n == "rows" else (N, N)) for n in HoleModule.LOADERS}
MAPPED = {"plain", "rows", "via_item", "contig"}


def storages(m: nn.Module) -> dict[int, str]:
    return {p.untyped_storage().data_ptr(): n for n, p in m.named_parameters()}


@pytest.fixture(scope="module")
def probed() -> tuple[HoleModule, dict[str, torch.Tensor], dict]:
    m = HoleModule()
    before = {n: t.clone() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    placements = build_placement(
        m.load_weights, storages(m), {n: (s, torch.float32) for n, s in SHAPES.items()}
    )
    return m, before, placements


def test_probe_never_writes_a_live_tensor(probed):
    m, before, _ = probed
    for n, t in [*m.named_parameters(), *m.named_buffers()]:
        assert torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)), n


@pytest.mark.parametrize("name", sorted(set(HoleModule.LOADERS) - MAPPED))
def test_unprovable_loaders_fall_back_with_no_segments(probed, name):
    placement = probed[2][name]
    assert placement.fallback_reason and placement.segments == [], placement


@pytest.mark.parametrize(
    "name,why",
    [
        ("out_add", "aten.add.out writes parameter out_add"),
        ("out_cat", "aten.cat.out writes parameter out_cat"),
        ("adv_setitem", "aten.index_put_.default writes parameter adv_setitem"),
        ("add_inplace", "aten.add_.Tensor writes parameter add_inplace"),
        ("buffer", "neither a parameter nor the loader's own"),
    ],
)
def test_the_refused_write_is_named(probed, name, why):
    assert why in probed[2][name].fallback_reason


def test_provable_loaders_map_exactly(probed):
    m, _, placements = probed
    assert all(placements[n].fallback_reason is None for n in MAPPED), {n: placements[n] for n in MAPPED}
    # Check each map against the loader itself, run for real on a fresh module with distinct values.
    fresh = HoleModule()
    ckpt = {n: torch.randn(s, generator=torch.Generator().manual_seed(99)) for n, s in SHAPES.items()}
    fresh.load_weights([(n, ckpt[n].clone()) for n in MAPPED])
    for n in MAPPED:
        flat = getattr(fresh, n).detach().reshape(-1)
        positions = torch.arange(ckpt[n].numel())
        held = 0
        for seg in placements[n].segments:
            got = locate([Piece(0, positions, ckpt[n].reshape(-1), seg, N * N)])
            assert torch.equal(flat[got.offsets], got.values), n
            held += got.positions.numel()
        assert held == N * N, n


def test_views_are_mapped_by_the_fast_pass_without_ids():
    """A narrow/transpose chain is read from the view's strides on a meta probe: no careful pass."""
    m = HoleModule()
    found, _ = P._probe_batch(m.load_weights, storages(m), [("rows", ((2 * N, N), torch.float32))])
    placement = found["rows"]
    assert placement.read and placement.segments == [Segment("rows", (N, N), N * N, (N, 1), 0, (1, N))]
    # `.item()` has no value on meta: not proven here
    assert P._probe_batch(m.load_weights, storages(m), [("via_item", ((N, N), torch.float32))])[0] is None


class BigShard(nn.Module):
    """Keeps the second half of a large checkpoint tensor, as a TP rank does."""

    ROWS, COLS = 1 << 14, 1 << 12  # 64 Mi elements: 256 MiB of int32 ids, 512 MiB of float64

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(
            torch.empty(self.ROWS // 2, self.COLS, dtype=torch.bfloat16), requires_grad=False
        )

    def load_weights(self, weights) -> None:
        for _, w in weights:
            self.w.data.copy_(w.narrow(0, self.ROWS // 2, self.ROWS // 2))


def test_probe_memory_is_far_below_one_id_tensor():
    m = BigShard()
    with PeakRss() as peak:
        placement = probe_tensor(m.load_weights, storages(m), "w", (m.ROWS, m.COLS), torch.bfloat16)
    assert placement.segments and placement.fallback_reason is None
    if peak.extra is None:
        pytest.skip("this kernel does not let a process reset its RSS high-water mark")
    assert peak.extra < (m.ROWS * m.COLS * 4) // 16, peak.extra  # ids would be 256 MiB


def test_a_tensor_the_loader_skips_is_unread_not_a_fallback():
    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = _zeros(N)

        def load_weights(self, weights) -> None:
            for name, w in weights:
                if name == "rotary.inv_freq":
                    continue
                self.p.data.copy_(w)

    m = Skips()
    placements = build_placement(
        m.load_weights, storages(m), {"rotary.inv_freq": ((N,), torch.float32), "p": ((N,), torch.float32)}
    )
    skipped = placements["rotary.inv_freq"]
    assert not skipped.read and skipped.segments == [] and skipped.fallback_reason is None
    assert placements["p"].read and placements["p"].whole_target() is not None


def test_careful_pass_ids_are_the_smallest_integer_dtype():
    """Meta first; then int32 ids (and their relabelling), not float64, where values are needed."""
    seen: list[torch.dtype] = []

    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = _zeros(N, N)

        def load_weights(self, weights) -> None:
            for _, w in weights:
                seen.append(w.dtype)
                if int(w.reshape(-1)[0].item()) >= 0:
                    self.p.data.copy_(w)

    m = ReadsValues()
    placement = probe_tensor(m.load_weights, storages(m), "p", (N, N), torch.bfloat16)
    assert placement.whole_target() is not None and placement.fallback_reason is None
    assert seen == [torch.bfloat16, torch.int32, torch.int32]
