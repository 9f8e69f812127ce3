"""The compiled CPU commit and digests (`kernels/scatter.py`, `kernels/digest.py`, numba) against the torch
path they
replace (`VLLM_DELTA_KERNELS=0`): the same weights bit for bit, the same digests and the same
errors, for fp8 / bf16 / fp16 / fp32 / int8 / uint8 values, ULP steps resolved on the live values
(wire.codecs.ulp_resolve, in numpy, is the independent reference), empty chunks, int32 and int64
offsets past 2^31, an offset outside the storage, and a write that does not land still caught by
the read-back; and whole applies of both paths equal to a direct load of the new checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness.synthetic import device_check

from vllm_delta.engine import commit, staging
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.commit import ApplyFault
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.staging import Chunk
from vllm_delta.kernels import scatter as scatter_kernel
from vllm_delta.kernels import switch
from vllm_delta.wire import additive
from vllm_delta.wire.codecs import ulp_resolve
from vllm_delta.wire.dtypes import by_torch

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")
DC = device_check()
DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int8,
    torch.uint8,
]


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "1" if request.param == "kernel" else "0")
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern equally likely (NaNs, infs, -0.0, subnormals included)."""
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(-(1 << (8 * width - 1)), 1 << (8 * width - 1), (n,), generator=g, dtype=torch.int64)
    return raw.to({1: torch.int8, 2: torch.int16, 4: torch.int32}[width]).view(dtype)


def _chunk(flat: torch.Tensor, n: int, g: torch.Generator, *, steps: bool, wide: bool = False):
    offsets = torch.randperm(flat.numel(), generator=g)[:n].sort().values
    offsets = offsets.to(torch.int64 if wide else torch.int32)
    if steps:
        width = flat.element_size()
        small = torch.randint(-3, 4, (n,), generator=g)
        big = torch.randint(-(1 << (8 * width - 1)), 1 << (8 * width - 1), (n,), generator=g)
        pick = torch.rand(n, generator=g) < 0.1  # a few escapes of any size, wrapping included
        values = torch.where(pick, big, small).to({1: torch.int8, 2: torch.int16, 4: torch.int32}[width])
        return Chunk(offsets, values, flat.dtype)
    return Chunk(offsets, _random(n, flat.dtype, g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("steps", [False, True])
def test_scatter_and_read_back_equal_the_torch_path(dtype, steps, monkeypatch):
    g = torch.Generator().manual_seed(DTYPES.index(dtype) * 2 + steps)
    start = _random(5000, dtype, g)
    # int64 offsets for one width only (each offset type and width is a compiled variant; 2^31 is tested
    # apart)
    chunks = [
        _chunk(start, n, g, steps=steps, wide=n == 7 and start.element_size() == 1)
        for n in (0, 1, 7, 1000, 5000)
    ]
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("VLLM_DELTA_KERNELS", mode)
        flat = start.clone()
        written = []
        for c in chunks:  # as the commit does: each chunk read back after its write (the last: every element)
            written.append(commit.scatter(flat, c))
            assert not bool(commit.read_back(flat, c.offsets, written[-1]))
        got[mode] = (flat, written)
    assert torch.equal(_bits(got["1"][0]), _bits(got["0"][0]))
    for a, b in zip(got["1"][1], got["0"][1]):
        assert a.dtype == b.dtype == dtype and torch.equal(_bits(a), _bits(b))
    if steps:  # independent reference: numpy's ULP resolve on the bits before the last chunk
        d = by_torch(dtype)
        last = chunks[-1]
        before = start.clone()
        monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
        for c in chunks[:-1]:
            commit.scatter(before, c)
        old = before.view(d.int_view).numpy().view(d.uint)[last.offsets.numpy()]
        want = ulp_resolve(old, last.values.numpy().view(d.uint), d)
        assert np.array_equal(_bits(got["1"][1][-1]).numpy().view(d.uint), want)


def test_kernel_runs_on_cpu_tensors_and_the_switch_turns_it_off(monkeypatch):
    """Which path runs: the kernel on CPU tensors, torch with VLLM_DELTA_KERNELS=0 or on meta."""
    calls = []
    real = scatter_kernel.scatter
    monkeypatch.setattr(scatter_kernel, "scatter", lambda *a: calls.append(1) or real(*a))
    flat = torch.zeros(10, dtype=torch.bfloat16)
    chunk = Chunk(torch.tensor([1, 3], dtype=torch.int32), torch.ones(2, dtype=torch.bfloat16))
    commit.scatter(flat, chunk)
    assert calls == [1] and flat[1] == 1
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    commit.scatter(flat, chunk)
    meta = torch.empty(10, dtype=torch.bfloat16, device="meta")
    monkeypatch.delenv("VLLM_DELTA_KERNELS")
    commit.scatter(meta, Chunk(chunk.offsets.to("meta"), chunk.values.to("meta")))
    assert calls == [1]


def test_offsets_past_2_31(path):
    """int64 offsets into a storage of more than 2^31 fp8 elements (untouched pages stay virtual)."""
    n = (1 << 31) + 64
    flat = torch.empty(n, dtype=torch.float8_e4m3fn)
    offsets = torch.tensor([5, (1 << 31) - 1, 1 << 31, n - 1], dtype=torch.int64)
    values = torch.tensor([1, 2, 3, 4], dtype=torch.uint8).view(torch.float8_e4m3fn)
    written = commit.scatter(flat, Chunk(offsets, values))
    assert torch.equal(flat.view(torch.uint8)[offsets], values.view(torch.uint8))
    assert not bool(commit.read_back(flat, offsets, written))
    steps = torch.tensor([1, -1, 2, 0], dtype=torch.int8)
    resolved = commit.scatter(flat, Chunk(offsets, steps, torch.float8_e4m3fn))
    want = ulp_resolve(
        np.array([1, 2, 3, 4], np.uint8), steps.numpy().view(np.uint8), by_torch(torch.float8_e4m3fn)
    )
    assert np.array_equal(flat.view(torch.uint8)[offsets].numpy(), want)
    assert np.array_equal(resolved.view(torch.uint8).numpy(), want)
    pos = offsets + (1 << 40)  # HF positions past 2^32 too
    got = staging.stage_sums(flat, offsets, pos, resolved, 0, 1, torch.float8_e4m3fn, False, True, True)
    want_sum = additive.partial_sum(pos, resolved)
    assert torch.equal(got[0][0], want_sum) and torch.equal(got[1][0], want_sum)


@pytest.mark.parametrize("steps", [False, True])
def test_an_offset_outside_the_storage_raises_before_any_write(path, steps):
    flat = torch.zeros(8, dtype=torch.bfloat16)
    bad = torch.tensor([0, 8], dtype=torch.int32)
    values = torch.ones(2, dtype=torch.int16) if steps else torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        commit.scatter(flat, Chunk(bad, values, torch.bfloat16 if steps else None))
    with pytest.raises(IndexError):
        commit.read_back(flat, torch.tensor([-1], dtype=torch.int32), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(IndexError):
        staging.stage_sums(flat, bad, torch.arange(2), values, 0, 1, torch.bfloat16, steps, True, True)
    if path == "kernel":
        assert not flat.any()  # the kernel checks every offset first


def test_read_back_sees_a_write_that_did_not_land(path):
    flat = torch.zeros(100, dtype=torch.bfloat16)
    chunk = Chunk(torch.arange(0, 100, 7, dtype=torch.int32), torch.ones(15, dtype=torch.bfloat16))
    written = commit.scatter(flat, chunk)
    assert not bool(commit.read_back(flat, chunk.offsets, written))
    flat[98] = 0  # the last write undone
    assert bool(commit.read_back(flat, chunk.offsets, written))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["plain", "pre", "steps"])
def test_stage_sums_equal_the_torch_path_and_partial_sum(dtype, mode, monkeypatch):
    """Per slot (runs of a tensor's entries, an empty slot, one slot given as an int), equal to the
    torch path and to `additive.partial_sum` of the old and new values gathered here."""
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    flat = _random(3000, dtype, g)
    n = 2000
    offsets = torch.randperm(3000, generator=g)[:n].to(torch.int32)
    positions = torch.randint(0, 1 << 40, (n,), generator=g)
    slots = torch.tensor([0] * 700 + [2] * 1 + [3] * 1299)  # slot 1 is empty
    steps = mode == "steps"
    values = _chunk(flat, n, g, steps=True).values if steps else _random(n, dtype, g)
    pre = mode != "plain"
    got = {}
    for kernels_on in ("1", "0"):
        monkeypatch.setenv("VLLM_DELTA_KERNELS", kernels_on)
        got[kernels_on] = [
            staging.stage_sums(flat, offsets, positions, values, s, 4, dtype, steps, pre, True)
            for s in (slots, 3)
        ]
    old = flat[offsets.long()]
    d = by_torch(dtype)
    new = (
        torch.from_numpy(
            ulp_resolve(_bits(old).numpy().view(d.uint), values.numpy().view(d.uint), d).view(
                _bits(old).numpy().dtype
            )
        ).view(dtype)
        if steps
        else values
    )
    for (kp, kq), (tp, tq), s in zip(got["1"], got["0"], (slots, 3)):
        assert torch.equal(kq, tq) and (kp is None) == (tp is None) == (not pre)
        if pre:
            assert torch.equal(kp, tp)
        for slot in range(4):
            keep = (slots == slot) if isinstance(s, torch.Tensor) else torch.full((n,), slot == s)
            assert torch.equal(kq[slot], additive.partial_sum(positions[keep], new[keep])), slot
            if pre:
                assert torch.equal(kp[slot], additive.partial_sum(positions[keep], old[keep])), slot


def test_stage_sums_of_no_entries(path):
    flat = torch.zeros(4, dtype=torch.bfloat16)
    none = torch.zeros(0, dtype=torch.int64)
    pre, post = staging.stage_sums(
        flat, none.to(torch.int32), none, flat[:0], none, 3, torch.bfloat16, False, True, True
    )
    assert not pre.any() and not post.any() and pre.shape == post.shape == (3, 2)


@pytest.mark.parametrize("encoding", ["ulp_zstd", "deltas_zstd"])
@pytest.mark.parametrize("block", [None, 5])
def test_whole_apply_is_exact_on_both_paths(tmp_path, path, encoding, block, monkeypatch):
    """prepare + commit through each path, against the loaders' own load of the new checkpoint;
    also with the kernel's chunks cut into blocks of 5 entries (`commit.CPU_BLOCK`: a block's last entry
    lands in the next one's first write)."""
    if block:
        monkeypatch.setattr(commit, "CPU_BLOCK", block)
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(tmp_path / "d", base, new, version=1, encoding=encoding)
    meta = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    assert check_partials([{"digests": staged.digests, "expected": staged.expected}]) == 2 * len(
        staged.expected
    )
    applier.commit(staged)
    want = DC.SyntheticLM(cfg)
    want.load_weights(new.items())
    got = dict(model.named_parameters())
    assert all(torch.equal(_bits(p), _bits(got[n])) for n, p in want.named_parameters())


@pytest.mark.parametrize("block", [None, 5])
def test_a_kernel_write_that_does_not_land_is_a_commit_fault(tmp_path, monkeypatch, block):
    """The kernel's write loses its last entry (a fake: a real one cannot be made to); the separate
    read-back of the live weights catches it as an ApplyFault naming the tensor (also where each
    block of 5 entries loses its last)."""
    if block:
        monkeypatch.setattr(commit, "CPU_BLOCK", block)
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    victim = "model.layers.1.mlp.experts.w13_weight"
    storage = applier.targets[victim].untyped_storage().data_ptr()
    real = scatter_kernel.scatter

    def loses_last(flat, offsets, values, base):
        if flat.untyped_storage().data_ptr() != storage:
            return real(flat, offsets, values, base)
        kept = flat[offsets[-1:].long()].clone()
        out = real(flat, offsets, values, base)
        flat[offsets[-1:].long()] = kept
        return out

    monkeypatch.setattr(scatter_kernel, "scatter", loses_last)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    with pytest.raises(ApplyFault, match="read-back") as fault:
        applier.commit(staged)
    assert fault.value.failed_at == victim and fault.value.suspect == [victim]
