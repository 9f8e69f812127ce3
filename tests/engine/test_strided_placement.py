"""Strided and interleaved placements: ownership and overlap, checked against a direct load.

Why: an interleaved gate/up (rows alternate gate, up) is written by a strided copy, and a rank of
an interleaved checkpoint keeps every other row or column. The probe maps these to segments
whose checkpoint ids have gaps, so `Segment.locate` must keep only the lattice's own ids (its
ownership mask), and the probe must refuse source strides that overlap (one checkpoint element
in two slots), where one element decides between "touch" and "overlap". Each apply runs the
product's probe, prepare and commit, and is compared bit for bit with a direct load: the same
loader run on the full new checkpoint into a fresh module, which shares nothing with the apply.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import Ownership, check_coverage, check_partials, coverage
from vllm_delta.wire import DeltaWriter, load_manifest, write_manifest
from vllm_delta.wire.additive import partial_sum, to_hex

H, I, R, C, N = 8, 6, 6, 16, 40  # noqa: E741 hidden, intermediate, rows, columns, flat length
TP = 2
BF16 = torch.bfloat16

# Interleaved tensors: each rank holds gate and up whole (into strided rows), and a strided part
# of the others, which the ranks together hold once.
REPLICATED = ("gate.weight", "up.weight")
INTERLEAVED = {
    "gate.weight": ((I, H), BF16),  # -> gate_up rows 0, 2, 4, ... (a strided destination)
    "up.weight": ((I, H), BF16),  # -> gate_up rows 1, 3, 5, ...
    "gu.weight": ((2 * I, H), BF16),  # interleaved rows g, u, g, u: rank r keeps rows r::2
    "cols.weight": ((R, C), BF16),  # rank r: columns [r C/2, (r+1) C/2), split by parity
    "flat.weight": ((N,), BF16),  # rank r keeps elements r::2
}
# Windows of a 1-D tensor (`unfold`): windows that touch at the boundary are a map; windows that
# share one element are not. Both plain (step 1 inside) and strided (every other element inside).
WINDOWS = {
    "touch.weight": ((N,), BF16, 2, 2, 1),  # [0 1] [2 3] ...
    "overlap.weight": ((N + 1,), BF16, 3, 2, 1),  # [0 1 2] [2 3 4] ...: element 2 twice
    "touch_strided.weight": ((N,), BF16, 5, 5, 2),  # [0 2 4] [5 7 9] ...: 5 = span 4 + 1
    "overlap_strided.weight": ((N + 1,), BF16, 5, 4, 2),  # [0 2 4] [4 6 8] ...: element 4 twice
}
WINDOW_CHECKPOINT = {name: (shape, dtype) for name, (shape, dtype, *_) in WINDOWS.items()}


def _windows(w: torch.Tensor, size: int, step: int, every: int) -> torch.Tensor:
    return w.unfold(0, size, step)[:, ::every]


class StridedModule(nn.Module):
    """One TP rank whose loaders do strided copies, in the vLLM shape: a `weight_loader` per Parameter."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        mk = lambda *shape: self._param(shape)  # noqa: E731
        self.gate_up = mk(2 * I, H)
        self.gu_half = mk(I, H)
        self.cols_even = mk(R, C // 4)
        self.cols_odd = mk(R, C // 4)
        self.flat_half = mk(N // 2)
        for name, ((length,), _, size, step, every) in WINDOWS.items():
            windows = (length - size) // step + 1
            setattr(self, name.split(".")[0], mk(windows, len(range(0, size, every))))

    def _param(self, shape: tuple[int, ...]) -> nn.Parameter:
        p = nn.Parameter(torch.zeros(shape, dtype=BF16), requires_grad=False)
        p.weight_loader = self._load  # type: ignore[attr-defined]
        return p

    def _load(self, param: nn.Parameter, w: torch.Tensor, name: str) -> None:
        r = self.rank
        if name in ("gate.weight", "up.weight"):
            param.data[int(name == "up.weight") :: 2].copy_(w)
        elif name == "gu.weight":
            param.data.copy_(w[r::2])
        elif name == "cols.weight":
            mine = w.narrow(1, r * C // 2, C // 2)
            self.cols_even.data.copy_(mine[:, 0::2])
            self.cols_odd.data.copy_(mine[:, 1::2])
        elif name == "flat.weight":
            param.data.copy_(w[r::2])
        else:
            _, _, size, step, every = WINDOWS[name]
            param.data.copy_(_windows(w, size, step, every))

    def load_weights(self, weights) -> None:
        targets = {
            "gate.weight": "gate_up",
            "up.weight": "gate_up",
            "gu.weight": "gu_half",
            "cols.weight": "cols_even",
            "flat.weight": "flat_half",
        }
        for name, w in weights:
            param = getattr(self, targets.get(name, name.split(".")[0]))
            param.weight_loader(param, w, name)


def checkpoint(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in spec.items()}


def stepped(old: dict[str, torch.Tensor], seed: int, density: float = 0.5) -> dict[str, torch.Tensor]:
    """About `density` of the elements move by a few ULPs, odd and even positions alike."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in old.items():
        bits = t.reshape(-1).view(torch.int16).clone()
        hit = torch.rand(bits.shape, generator=g) < density
        bits[hit] += torch.randint(1, 4, bits.shape, generator=g, dtype=torch.int16)[hit]
        out[n] = bits.view(BF16).reshape(t.shape)
    return out


def write_delta(path, old, new, *, encoding: str, digests: bool) -> None:
    """A delta old -> new (bitwise changed positions), with pre/post digests of the full tensors if asked."""
    sums = {}
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding) as w:
        for name, t in new.items():
            a, b = old[name].reshape(-1), t.reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            w.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))
            sums[name] = dict(
                pre_digest=to_hex(partial_sum(pos, a[pos])), post_digest=to_hex(partial_sum(pos, b[pos]))
            )
    if digests:
        manifest = load_manifest(path)
        write_manifest(
            path,
            manifest.model_copy(
                update={"params": [p.model_copy(update=sums[p.name]) for p in manifest.params]}
            ),
        )


def direct(ckpt: dict[str, torch.Tensor], rank: int) -> StridedModule:
    """The reference: the module's own loaders run on the full checkpoint tensors."""
    m = StridedModule(rank)
    m.load_weights(ckpt.items())
    return m


def assert_same_bits(got: nn.Module, want: nn.Module) -> None:
    expected = dict(want.named_parameters())
    bad = [
        n
        for n, p in got.named_parameters()
        if not torch.equal(p.view(torch.int16), expected[n].view(torch.int16))
    ]
    assert bad == []


def test_strided_loaders_are_mapped_and_the_ranks_cover_each_element_once():
    appliers = [DeltaApplier(StridedModule(r), INTERLEAVED) for r in range(TP)]
    for applier in appliers:
        assert applier.fallback_tensors == {}
    (gate,), (up,) = (appliers[0].placements[n].segments for n in ("gate.weight", "up.weight"))
    assert (gate.dst_offset, gate.dst_strides, up.dst_offset, up.dst_strides) == (
        0,
        (2 * H, 1),
        H,
        (2 * H, 1),
    )
    (gu,) = appliers[1].placements["gu.weight"].segments
    assert (gu.src_offset, gu.src_strides, gu.src_last - gu.src_offset + 1 == gu.numel) == (
        H,
        (2 * H, 1),
        False,
    )
    (flat,) = appliers[1].placements["flat.weight"].segments
    assert (flat.src_offset, flat.src_strides, flat.sizes) == (1, (2,), (N // 2,))
    odd = next(s for s in appliers[1].placements["cols.weight"].segments if s.target == "cols_odd")
    assert (odd.src_offset, odd.src_strides, odd.sizes) == (C // 2 + 1, (C, 2), (R, C // 4))
    replies = [{"coverage": coverage(a.placements)} for a in appliers]
    assert check_coverage(replies, {n: s for n, (s, _) in INTERLEAVED.items()})["ok"]


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_strided_apply_equals_a_direct_load(tmp_path, encoding):
    base = checkpoint(INTERLEAVED, seed=0)
    new = stepped(base, seed=1)
    write_delta(tmp_path / "d", base, new, encoding=encoding, digests=True)
    models = [direct(base, r) for r in range(TP)]
    appliers = [DeltaApplier(m, INTERLEAVED, rank=r) for r, m in enumerate(models)]
    for r, applier in enumerate(appliers):
        applier.ownership = Ownership.from_coverages([coverage(a.placements) for a in appliers], r)
    staged = [a.prepare(tmp_path / "d", version=1, base_version=0, current_version=0) for a in appliers]
    # Each changed element is written once per rank holding it: gate and up on every rank, the rest on one.
    replicated = sum(int((base[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in REPLICATED)
    assert sum(s.changed for s in staged) == staged[0].total_changed + (TP - 1) * replicated
    assert check_partials([{"digests": s.digests, "expected": s.expected} for s in staged]) == 2 * len(
        INTERLEAVED
    )
    for r, (applier, s) in enumerate(zip(appliers, staged)):
        applier.commit(s)
        assert_same_bits(models[r], direct(new, r))


def test_windows_that_touch_are_mapped_and_windows_sharing_one_element_are_refused():
    placements = DeltaApplier(StridedModule(0), WINDOW_CHECKPOINT).placements
    for name in ("touch.weight", "touch_strided.weight"):
        assert placements[name].fallback_reason is None and len(placements[name].segments) == 1, name
    assert placements["touch_strided.weight"].segments[0].src_strides == (5, 2)
    for name in ("overlap.weight", "overlap_strided.weight"):
        assert placements[name].segments == [] and "overlapping" in placements[name].fallback_reason, name


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_window_apply_equals_a_direct_load(tmp_path, encoding):
    """Touching windows go through their segments, overlapping ones through the loader's replay."""
    base = checkpoint(WINDOW_CHECKPOINT, seed=2)
    new = stepped(base, seed=3)
    write_delta(tmp_path / "d", base, new, encoding=encoding, digests=False)
    model = direct(base, 0)
    applier = DeltaApplier(model, WINDOW_CHECKPOINT, read=lambda name: base[name])
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    assert staged.fallback_names == ["overlap.weight", "overlap_strided.weight"]
    applier.commit(staged)
    assert_same_bits(model, direct(new, 0))
