"""The apply path is device-correct: staged data meets each parameter on the parameter's device.

Why the `meta` device: CI has no GPU, and PyTorch refuses to mix a CPU tensor with a meta one in
the kernels the commit uses, just as it refuses CPU with CUDA. So prepare + commit on a model
whose parameters are all on `meta` fails wherever a staged tensor stayed on the CPU. A meta
commit computes no values, so what it did is read from the ops it dispatched (`harness/dispatch_log`).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from harness.dispatch_log import OpLog
from harness.synthetic import device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import Ownership, check_partials, coverage
from vllm_delta.engine.staging import StagingBoundError, flat_storage, gather
from vllm_delta.wire import codecs, open_delta
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
    got = codecs.ulp_resolve_tensor(
        torch.from_numpy(old.copy()).view(d.int_view).view(d.torch),
        torch.from_numpy(steps.copy()).view(d.int_view),
    )
    assert np.array_equal(got.view(d.int_view).numpy().view(d.uint), want)


def test_a_cpu_chunk_meeting_a_meta_parameter_raises():
    """The trick itself: a commit that left staged data on the CPU fails in CI."""
    flat = torch.zeros(16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        flat.index_copy_(0, torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="different devices"):  # index_select on meta accepts CPU indices
        gather(flat, torch.tensor([1]))


def write_plain_delta(
    path, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], encoding: str
) -> None:
    """No digests: those are read back to the host, which meta cannot do."""
    with DC.DeltaWriter(path, version=1, base_version=0, encoding=encoding) as w:
        for name, t in new.items():
            a, b = base[name].reshape(-1), t.reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            if pos.numel():
                w.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))


def changed_slots(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], rank: int) -> dict[str, int]:
    """Per parameter of `rank`, the elements that differ between direct loads of `base` and `new`."""
    old = dict(loaded(base, rank, 2).named_parameters())
    counts = {
        n: int((p.view(torch.int16) != old[n].view(torch.int16)).sum())
        for n, p in loaded(new, rank, 2).named_parameters()
    }
    return {n: c for n, c in counts.items() if c}


def scattered(log: OpLog, model: torch.nn.Module) -> list[tuple[str, int]]:
    """(parameter, elements) of each `index_copy_` the commit ran, in order."""
    names = {p.untyped_storage()._cdata: n for n, p in model.named_parameters()}
    return [
        (names[op.inputs[0].untyped_storage()._cdata], op.inputs[1].numel())
        for op in log.named("index_copy_")
    ]


def commit_logged(applier: DeltaApplier, path) -> tuple[OpLog, OpLog, int]:
    """Prepare and commit, logging both; returns the logs and the number of staged chunks."""
    with OpLog() as prepared:
        staged = applier.prepare(path, version=1, base_version=0, current_version=0)
    chunks = sum(len(cs) for cs in staged.writes.values())
    device = next(iter(applier.targets.values())).device
    assert staged.changed and all(c.offsets.device == device for cs in staged.writes.values() for c in cs)
    with OpLog() as log:
        applier.commit(staged)
    return prepared, log, chunks


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_prepare_and_commit_on_meta_parameters(tmp_path, encoding, monkeypatch):
    """On meta: every changed slot is scattered, on the parameter's device, with no host round trip.

    The same delta on CPU ranks runs the same scatters and equals a direct load of the new
    checkpoint, so what the meta run did is what gives exact weights.
    """
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.2, seed=1)
    write_plain_delta(tmp_path / "d", base, new, encoding)
    for rank in range(2):
        want = changed_slots(base, new, rank)
        # Probed where storages have addresses.
        placements = DeltaApplier(DC.SyntheticLM(CFG, rank=rank, tp=2), META).placements
        meta_model = DC.SyntheticLM(CFG, rank=rank, tp=2, device="meta")
        prepared, log, chunks = commit_logged(
            DeltaApplier(meta_model, META, placements=placements, rank=rank), tmp_path / "d"
        )
        writes = scattered(log, meta_model)
        assert len(writes) == chunks
        totals: dict[str, int] = {}
        for name, n in writes:
            totals[name] = totals.get(name, 0) + n
        if encoding == "ulp_zstd":  # decoded on meta (wire/batch_device.py): no values to count the owned
            assert totals.keys() == want.keys() and all(
                totals[n] >= want[n] for n in want
            )  # entries by, so a bound
        else:
            assert totals == want
        # Host to device in prepare: each chunk's positions and values, once, and at most one table of
        # its pieces' numbers (engine/batched.py locates on the device), non-blocking. Nothing comes back.
        uploads = prepared.copies("cpu", "meta")
        flushes = len(
            open_delta(tmp_path / "d").manifest.files
        )  # decoded on meta: two uploads per flush batch
        lo, hi = (1, chunks + 2 * flushes) if encoding == "ulp_zstd" else (2 * chunks, 3 * chunks)
        assert lo <= len(uploads) <= hi and all(
            op.name == "_to_copy" and op.kwargs["non_blocking"] for op in uploads
        )
        assert prepared.copies("meta", "cpu") == [] and prepared.host_reads() == []
        # The commit runs on the device alone: no copy either way, no host read.
        assert log.copies("cpu", "meta") == [] and log.copies("meta", "cpu") == [] and log.host_reads() == []
        assert all(op.devices() == {"meta"} for op in log.ops if op.inputs)
        # Current values gathered once per chunk where ULP steps resolve, and once per chunk to read back.
        assert len(log.named("index_select")) == (2 if encoding == "ulp_zstd" else 1) * chunks

        cpu_model = loaded(base, rank, 2)
        monkeypatch.setenv(
            "VLLM_DELTA_KERNELS", "0"
        )  # CPU weights: the torch path, whose scatters are counted
        _, cpu_log, _ = commit_logged(DeltaApplier(cpu_model, META, rank=rank), tmp_path / "d")
        cpu_writes = scattered(cpu_log, cpu_model)
        assert [n for n, _ in cpu_writes] == [n for n, _ in writes]
        assert all(a <= b if encoding == "ulp_zstd" else a == b for (_, a), (_, b) in zip(cpu_writes, writes))
        assert same_bits(cpu_model, loaded(new, rank, 2)) == []


def test_staged_update_is_int32_and_bounded_in_total(tmp_path):
    """Offsets stage as int32 and values at their width; `max_staged_bytes` bounds the whole staged
    update: one byte under what it needs and prepare refuses (413, naming the bound by its flag) with
    the weights untouched."""
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=2)
    DC.write_delta(tmp_path / "d", base, new, version=1)
    models, _ = tp_ranks(tmp_path / "model", base, tp=2)
    appliers = [DeltaApplier(model, META, rank=rank) for rank, model in enumerate(models)]
    for rank, applier in enumerate(appliers):
        applier.ownership = Ownership.from_coverages([coverage(a.placements) for a in appliers], rank)
    replies = []
    for rank, (model, applier) in enumerate(zip(models, appliers)):
        staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
        replies.append({"digests": staged.digests, "expected": staged.expected})
        chunks = [c for cs in staged.writes.values() for c in cs]
        for c in chunks:
            assert (
                c.offsets.dtype == torch.int32 and c.values.dtype == torch.int16 and c.base == torch.bfloat16
            )
        assert (
            staged.staged_bytes
            == sum(c.offsets.nbytes + c.values.nbytes for c in chunks)
            == 6 * staged.changed
        )
        before = {n: p.clone() for n, p in model.named_parameters()}
        with pytest.raises(
            StagingBoundError, match=f"--delta-updates-max-staged-bytes={staged.staged_bytes - 1} bytes"
        ) as refused:
            applier.prepare(
                tmp_path / "d",
                version=1,
                base_version=0,
                current_version=0,
                max_staged_bytes=staged.staged_bytes - 1,
            )
        assert refused.value.http_status == 413
        assert all(
            torch.equal(p.view(torch.int16), before[n].view(torch.int16)) for n, p in model.named_parameters()
        )
        applier.prepare(
            tmp_path / "d", version=1, base_version=0, current_version=0, max_staged_bytes=staged.staged_bytes
        )  # exactly at the bound: accepted
        applier.commit(staged)
        assert not any(staged.writes.values())
        assert same_bits(model, loaded(new, rank, 2)) == []
    assert check_partials(replies) == 2 * len(replies[0]["expected"])


def test_flat_storage_keeps_the_device():
    t = torch.zeros(4, 4, device="meta")[1:]
    assert flat_storage(t).device.type == "meta" and flat_storage(t).numel() == 16


@pytest.mark.heavy  # a subprocess
def test_the_apply_path_imports_without_vllm():
    """benchmarks/device_check.py runs it where vLLM is not installed."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm': raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vllm_delta.engine.apply, vllm_delta.engine.digests, vllm_delta.engine.placement\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
