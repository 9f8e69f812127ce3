"""The apply path is device-correct: staged data meets each parameter on the parameter's device.

Why the `meta` device: CI has no GPU, and PyTorch refuses to mix a CPU tensor with a meta one in
the kernels the commit uses, just as it refuses CPU with CUDA. So prepare + commit on a model
whose parameters are all on `meta` fails wherever a staged tensor stayed on the CPU.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from harness.synthetic import device_check, loaded, same_bits, tp_ranks
from vllm_delta.engine.apply import DeltaApplier, flat_storage, gather
from vllm_delta.engine.digests import Ownership, check_partials, coverage
from vllm_delta.wire import codecs
from vllm_delta.wire.dtypes import _ALL

DC = device_check()
CFG = DC.SIZES["tiny"]
META = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(CFG).items()}


@pytest.mark.parametrize("d", _ALL, ids=lambda d: d.name)
def test_torch_ulp_resolve_equals_numpy(d):
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, size=4096 * d.itemsize, dtype=np.uint8).view(d.uint)
    steps = rng.integers(0, 256, size=4096 * d.itemsize, dtype=np.uint8).view(d.uint)
    want = codecs.ulp_resolve(old, steps, d)
    got = codecs.ulp_resolve_tensor(torch.from_numpy(old.copy()).view(d.int_view).view(d.torch),
                                    torch.from_numpy(steps.copy()).view(d.int_view))
    assert np.array_equal(got.view(d.int_view).numpy().view(d.uint), want)


def test_a_cpu_chunk_meeting_a_meta_parameter_raises():
    """The trick itself: a commit that left staged data on the CPU fails in CI."""
    flat = torch.zeros(16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        flat.index_copy_(0, torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="different devices"):  # index_select on meta accepts CPU indices
        gather(flat, torch.tensor([1]))


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_prepare_and_commit_on_meta_parameters(tmp_path, encoding):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.2, seed=1)
    path = tmp_path / "d"
    with DC.DeltaWriter(path, version=1, base_version=0, encoding=encoding) as w:
        for name, t in new.items():
            a, b = base[name].reshape(-1), t.reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            if pos.numel():  # no digests: those are read back to the host, which meta cannot do
                w.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))
    for rank in range(2):
        cpu_model = DC.SyntheticLM(CFG, rank=rank, tp=2)
        placements = DeltaApplier(cpu_model, META).placements  # probed where storages have addresses
        meta_model = DC.SyntheticLM(CFG, rank=rank, tp=2, device="meta")
        applier = DeltaApplier(meta_model, META, placements=placements, rank=rank)
        staged = applier.prepare(path, version=1, base_version=0, current_version=0, chunk_bytes=64)
        assert staged.changed and all(c.offsets.device.type == "cpu" for cs in staged.writes.values() for c in cs)
        applier.commit(staged)


def test_chunks_are_bounded_int32_and_freed_as_scattered(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=2)
    DC.write_delta(tmp_path / "d", base, new, version=1)
    models, _ = tp_ranks(tmp_path / "model", base, tp=2)
    appliers = [DeltaApplier(model, META, rank=rank) for rank, model in enumerate(models)]
    for rank, applier in enumerate(appliers):
        applier.ownership = Ownership.from_coverages([coverage(a.placements) for a in appliers], rank)
    replies = []
    for rank, (model, applier) in enumerate(zip(models, appliers)):
        staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0, chunk_bytes=60)
        replies.append({"digests": staged.digests, "expected": staged.expected})  # summed 60 B at a time
        chunks = [c for cs in staged.writes.values() for c in cs]
        assert len(chunks) > len(staged.writes)  # split by the byte bound
        for c in chunks:
            assert c.offsets.dtype == torch.int32 and c.values.dtype == torch.int16 and c.base == torch.bfloat16
            assert c.offsets.numel() * 6 <= 60
            assert c.offsets.untyped_storage().nbytes() == c.offsets.nbytes  # owns its memory: freed when popped
        applier.commit(staged)
        assert not any(staged.writes.values())
        assert same_bits(model, loaded(new, rank, 2)) == []
    assert check_partials(replies) == 2 * len(replies[0]["expected"])


def test_flat_storage_keeps_the_device():
    t = torch.zeros(4, 4, device="meta")[1:]
    assert flat_storage(t).device.type == "meta" and flat_storage(t).numel() == 16


def test_the_apply_path_imports_without_vllm():
    """benchmarks/device_check.py runs it where vLLM is not installed."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'vllm': raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import vllm_delta.engine.apply, vllm_delta.engine.digests, vllm_delta.engine.placement\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
