"""The whole prepare with the delta decoded on the parameters' device (wire/batch_device.py).

Why meta: CI has no GPU. With the model on `meta`, the reader decodes there, so a decoded tensor
left on the host, or a host read of a device value, fails or shows in the op log. On the CPU
(`batched.FORCE_DEVICE_PATH`) the same code runs with values, and stages exactly what the host path
stages (the host path is the reference: numpy decode, host locate).
"""

from __future__ import annotations

import pytest
import torch
from harness.dispatch_log import OpLog
from harness.synthetic import device_check
from test_batched_apply import moe
from test_device_path import write_plain_delta
from wire.test_batch import _Z, _retouched

from vllm_delta.engine import batched
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.placement import owned_by_tensor
from vllm_delta.wire import CorruptDeltaError, batch_device, iter_delta, open_delta
from vllm_delta.wire.batch_device import HOST

DC = device_check()
BF16 = torch.bfloat16


def meta_prepare(path, cfg, *, device_decode: bool = True, tp: int = 2, rank: int = 1):
    """Prepare on a meta model of `rank` (placements probed on the CPU): (op log, staged, entries decoded)."""
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    placements = DeltaApplier(DC.SyntheticLM(cfg, rank=rank, tp=tp), meta).placements
    applier = DeltaApplier(
        DC.SyntheticLM(cfg, rank=rank, tp=tp, device="meta"), meta, placements=placements, rank=rank
    )
    if not device_decode:
        applier._decoder = lambda: HOST
    with OpLog() as log:
        staged = applier.prepare(path, version=1, base_version=0, current_version=0)
    decoded = sum(
        d.count for d in iter_delta(open_delta(path), current_version=0, owned=owned_by_tensor(placements))
    )
    return log, staged, decoded


def h2d(log: OpLog) -> int:
    uploads = log.copies("cpu", "meta")
    assert uploads and all(op.name == "_to_copy" and op.kwargs["non_blocking"] for op in uploads)
    return sum(op.outputs[0].nbytes for op in uploads)


def delta(tmp_path, cfg, density: float, encoding: str = "ulp_zstd"):
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    path = tmp_path / f"{encoding}-{density}-{cfg.experts}"
    write_plain_delta(
        path, base, DC.step(base, density, seed=1), encoding
    )  # no digests: meta reads none back
    return path


@pytest.mark.parametrize("encoding", ["ulp_zstd", "planes_zstd", "deltas_zstd"])
def test_prepare_on_meta_decodes_there_with_no_sync_and_fewer_bytes_across(tmp_path, encoding, capsys):
    """Fused experts at TP=2, rank 1 (row and column shards): every decoded tensor on meta, nothing read
    back, no device `nonzero` (compaction sizes come from one count read per batch, skipped on meta);
    host->device bytes per decoded change below the host decode's (int32 positions + values + tables)."""
    cfg = DC.Config(
        vocab=64,
        hidden=128,
        layers=1,
        heads=4,
        kv_heads=1,
        head_dim=32,
        inter=96,
        moe_layers=1,
        experts=8,
        moe_inter=64,
    )  # about 2k changes a tensor: the per-block table is small beside them
    path = delta(tmp_path, cfg, 0.3, encoding)
    log, staged, decoded = meta_prepare(path, cfg)
    assert (
        all(
            c.offsets.device.type == "meta" and c.values.device.type == "meta"
            for cs in staged.writes.values()
            for c in cs
        )
        and staged.changed
    )
    assert log.copies("meta", "cpu") == [] and log.host_reads() == []
    assert [op for op in log.named("nonzero") if op.devices() != {"cpu"}] == []
    assert any(
        op.name == "cumsum" and op.devices() == {"meta"} for op in log.ops
    )  # the gaps' cumsum ran there
    host_log, _, _ = meta_prepare(path, cfg, device_decode=False)
    ours, theirs = h2d(log) / decoded, h2d(host_log) / decoded
    with capsys.disabled():
        print(f"\n{encoding}: host->device {ours:.2f} B per decoded change (host decode: {theirs:.2f} B)")
    assert ours < theirs


def test_prepare_ops_on_meta_do_not_grow_with_the_expert_tensors(tmp_path):
    """8x the checkpoint tensors behind each fused param: the same ops, reader and staging together,
    but for each tensor's view of its batch (`slice`: metadata, no kernel)."""
    counts = []
    for experts in (4, 32):
        cfg = moe(1, experts)
        path = delta(tmp_path, cfg, 0.5)
        meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
        placements = DeltaApplier(DC.SyntheticLM(cfg, rank=1, tp=2), meta).placements
        applier = DeltaApplier(
            DC.SyntheticLM(cfg, rank=1, tp=2, device="meta"), meta, placements=placements, rank=1
        )
        with OpLog() as log:
            applier.prepare(path, version=1, base_version=0, current_version=0)
        counts.append(sum(op.name != "slice" for op in log.ops))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_forced_device_decode_on_cpu_stages_what_the_host_path_stages(tmp_path, monkeypatch, tp, rank):
    """With digests (pre and post, summed from the device-decoded entries), against the host path."""
    cfg = moe(2, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    DC.write_delta(tmp_path / "d", base, DC.step(base, 0.3, seed=1), version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    calls = []
    real = batch_device.Decoder.decode

    def counted(self, batch, enc, device, itemsizes):  # the batches decoded for a device (not the host's)
        calls.extend([1] if device is not None else [])
        return real(self, batch, enc, device, itemsizes)

    monkeypatch.setattr(batch_device.Decoder, "decode", counted)

    def staged(force: bool):
        model = DC.SyntheticLM(cfg, rank=rank, tp=tp)
        model.load_weights(base.items())
        monkeypatch.setattr(batched, "FORCE_DEVICE_PATH", force)
        return DeltaApplier(model, meta, rank=rank).prepare(
            tmp_path / "d", version=1, base_version=0, current_version=0
        )

    host = staged(False)
    assert not calls
    dev = staged(True)
    assert calls
    assert dev.digests == host.digests and any(v[0] and v[1] for v in host.digests.values())
    assert dev.changed == host.changed > 0 and list(dev.writes) == list(host.writes)
    for target, chunks in host.writes.items():
        for a, b in zip(chunks, dev.writes[target], strict=True):
            assert (
                a.base == b.base and a.offsets.dtype == b.offsets.dtype and torch.equal(a.offsets, b.offsets)
            )
            assert a.values.dtype == b.values.dtype and torch.equal(
                a.values.view(torch.uint8), b.values.view(torch.uint8)
            )


def test_device_decoded_bytes_that_disagree_with_the_index_fail_prepare(tmp_path, monkeypatch):
    """Gap bytes past the block index's last position, on the forced device decode: prepare raises
    (the batch's device check, read once at its end) and nothing is staged."""
    cfg = moe(1, 4)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    path = delta(tmp_path, cfg, 0.3)
    _retouched(
        path, "model.layers.0.mlp.experts.2.up_proj.weight", "pos0", lambda n: _Z.compress(b"\xff" * n)
    )
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    monkeypatch.setattr(batched, "FORCE_DEVICE_PATH", True)
    with pytest.raises(CorruptDeltaError):
        DeltaApplier(model, meta).prepare(path, version=1, base_version=0, current_version=0)


def test_a_destination_fed_by_device_and_host_decoded_tensors(tmp_path, monkeypatch):
    """Half the experts behind each fused param decoded on the (CPU) device, half on the host: two
    chunks per destination, one per kind, and the commit gives the new checkpoint's weights exactly."""
    cfg = moe(1, 8)
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(tmp_path / "d", base, new, version=1)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    model = DC.SyntheticLM(cfg)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    monkeypatch.setattr(batched, "FORCE_DEVICE_PATH", True)
    real = applier._decoder

    def half() -> batch_device.Decoder:
        devices = real().devices.items()
        return batch_device.Decoder(
            {n: d for n, d in devices if ".experts." not in n or int(n.split(".")[5]) % 2}
        )

    monkeypatch.setattr(applier, "_decoder", half)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    fused = [t for t in staged.writes if "experts" in t]
    assert fused and all(len(staged.writes[t]) == 2 for t in fused)
    assert check_partials([{"digests": staged.digests, "expected": staged.expected}]) > 0
    applier.commit(staged)
    want = DC.SyntheticLM(cfg)
    want.load_weights(new.items())
    got = dict(model.named_parameters())
    assert all(torch.equal(p.view(torch.int16), got[n].view(torch.int16)) for n, p in want.named_parameters())


def test_device_and_host_decoded_tensors_of_one_destination_never_meet_on_meta(tmp_path):
    """The same split on meta: a device-decoded piece (on meta) beside a host-decoded one (on the CPU)
    in one locate would fail there, as it would on a GPU."""
    cfg = moe(1, 8)
    path = delta(tmp_path, cfg, 0.3)
    meta = {n: (s, BF16) for n, s in DC.checkpoint_shapes(cfg).items()}
    placements = DeltaApplier(DC.SyntheticLM(cfg), meta).placements
    applier = DeltaApplier(DC.SyntheticLM(cfg, device="meta"), meta, placements=placements)
    real = applier._decoder
    applier._decoder = lambda: batch_device.Decoder(
        {n: d for n, d in real().devices.items() if ".experts." not in n or int(n.split(".")[5]) % 2}
    )
    staged = applier.prepare(path, version=1, base_version=0, current_version=0)
    fused = [t for t in staged.writes if "experts" in t]
    assert fused and all(len(staged.writes[t]) == 2 for t in fused)
    assert all(c.offsets.device.type == "meta" for cs in staged.writes.values() for c in cs)
