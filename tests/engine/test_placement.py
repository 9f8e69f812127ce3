"""Placement and two-phase apply on a small module whose `load_weights` mimics vLLM's loaders.

These run without an engine: the module packs q/k/v into one parameter, keeps a TP-like row
slice, transposes one weight, and has loaders that cannot be mapped exactly (scaling, in-place
fills). The real-engine matrix is in test_apply_bitexact.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.probe import build_placement
from vllm_delta.engine.staging import flat_storage
from vllm_delta.engine.worker import DeltaWorkerExtension
from vllm_delta.wire import DeltaWriter, VersionError, tensor_digest
from vllm_delta.wire.errors import IncompatibleDeltaError, UnknownParamError

H = 8
CHECKPOINT = {
    "q.weight": ((H, H), torch.bfloat16),
    "k.weight": ((H // 2, H), torch.bfloat16),
    "v.weight": ((H // 2, H), torch.bfloat16),
    "shard.weight": ((2 * H, H), torch.bfloat16),  # this "rank" keeps rows H..2H
    "t.weight": ((H, 2 * H), torch.bfloat16),  # stored transposed
    "norm.weight": ((H,), torch.float32),
    "scaled.weight": ((H,), torch.bfloat16),  # loader multiplies: not an exact copy
    "filled.weight": ((H,), torch.bfloat16),  # loader fills in place: not an exact copy
}


class PackedModule(nn.Module):
    """A vLLM-like module: stacked qkv, a TP row shard, a transposed weight, odd loaders."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(2 * H, H, dtype=torch.bfloat16), requires_grad=False)
        self.shard = nn.Parameter(torch.zeros(H, H, dtype=torch.bfloat16), requires_grad=False)
        self.t = nn.Parameter(torch.zeros(2 * H, H, dtype=torch.bfloat16), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.scaled = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.filled = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        rows = {"q.weight": (0, H), "k.weight": (H, H // 2), "v.weight": (H + H // 2, H // 2)}
        for name, w in weights:
            if name in rows:
                start, n = rows[name]
                self.qkv.data.narrow(0, start, n).copy_(w)
            elif name == "shard.weight":
                self.shard.data.copy_(w.narrow(0, H, H))
            elif name == "t.weight":
                self.t.data.copy_(w.t())
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            elif name == "scaled.weight":
                self.scaled.data.copy_(w * 2)
            elif name == "filled.weight":
                self.filled.data.fill_(0)
                self.filled.data[:] = w
            else:
                raise KeyError(name)


def random_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in CHECKPOINT.items()}


def loaded(ckpt: dict[str, torch.Tensor]) -> PackedModule:
    m = PackedModule()
    m.load_weights(ckpt.items())
    return m


def storages(m: nn.Module) -> dict[int, str]:
    return {p.untyped_storage().data_ptr(): n for n, p in m.named_parameters()}


def test_probe_maps_packing_slicing_and_transpose():
    m = PackedModule()
    placements = build_placement(m.load_weights, storages(m), CHECKPOINT)
    (k,) = placements["k.weight"].segments
    assert (k.target, k.src_offset, k.dst_offset, k.numel) == ("qkv", 0, H * H, H // 2 * H)
    assert placements["shard.weight"].segments[0].src_offset == H * H  # rows H.. of the checkpoint
    assert placements["shard.weight"].whole_target() is None
    assert placements["t.weight"].whole_target() is not None
    assert placements["scaled.weight"].fallback_reason and not placements["scaled.weight"].segments
    assert "writes parameter filled" in placements["filled.weight"].fallback_reason
    assert all(
        placements[n].fallback_reason is None
        for n in ("q.weight", "k.weight", "v.weight", "t.weight", "norm.weight")
    )


def test_probe_never_writes_a_parameter():
    m = loaded(random_checkpoint(0))
    before = {n: p.clone() for n, p in m.named_parameters()}
    build_placement(m.load_weights, storages(m), CHECKPOINT)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def perturbed(ckpt: dict[str, torch.Tensor], names, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in ckpt.items():
        t = t.clone()
        if n in names:
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
            flat[idx] = torch.randn(idx.numel(), generator=g).to(t.dtype)
        out[n] = t
    return out


def write_delta(path, old, new, *, version=1, base_version=0, encoding="ulp_zstd", post_hash=True):
    with DeltaWriter(path, version=version, base_version=base_version, encoding=encoding) as w:
        for n in old:
            diff = (
                old[n].view(torch.int16 if old[n].dtype == torch.bfloat16 else torch.int32)
                != new[n].view(torch.int16 if new[n].dtype == torch.bfloat16 else torch.int32)
            ).reshape(-1)
            pos = torch.nonzero(diff).squeeze(1)
            if pos.numel():
                w.add(
                    n,
                    pos,
                    new[n].reshape(-1)[pos],
                    old[n].reshape(-1)[pos],
                    shape=old[n].shape,
                    post_hash=tensor_digest(new[n]) if post_hash else None,
                )
    return path


MAPPABLE = ["q.weight", "k.weight", "v.weight", "shard.weight", "t.weight", "norm.weight"]


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices", "planes_zstd"])
def test_apply_equals_full_load(tmp_path, encoding):
    old = random_checkpoint(0)
    new = perturbed(old, MAPPABLE, seed=1)
    m = loaded(old)
    applier = DeltaApplier(m, CHECKPOINT)
    staged = applier.prepare(
        write_delta(tmp_path / "d", old, new, encoding=encoding), version=1, base_version=0, current_version=0
    )
    assert staged.changed < staged.total_changed  # rows 0..H of shard.weight live on another rank
    applier.commit(staged)
    want = loaded(new)
    for n, p in m.named_parameters():
        assert torch.equal(p.view(torch.uint8), getattr(want, n).view(torch.uint8)), n


def test_prepare_failure_changes_nothing(tmp_path):
    old = random_checkpoint(0)
    m = loaded(old)
    before = {n: p.clone() for n, p in m.named_parameters()}
    applier = DeltaApplier(m, {k: v for k, v in CHECKPOINT.items() if k != "norm.weight"})
    delta = write_delta(tmp_path / "d", old, perturbed(old, MAPPABLE, seed=2))
    with pytest.raises(UnknownParamError):
        applier.prepare(delta, version=1, base_version=0, current_version=0)
    with pytest.raises(VersionError):
        DeltaApplier(m, CHECKPOINT).prepare(delta, version=1, base_version=0, current_version=1)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_post_hash_is_checked_on_demand(tmp_path):
    old = random_checkpoint(0)
    new = perturbed(old, ["t.weight"], seed=3)
    m = loaded(old)
    applier = DeltaApplier(m, CHECKPOINT)
    staged = applier.prepare(
        write_delta(tmp_path / "d", old, new), version=1, base_version=0, current_version=0
    )
    applier.commit(staged)
    hashes = {n: h for n, (_, h) in staged.after.items()}
    assert applier.post_hash_mismatches(hashes) == (1, [])
    assert applier.post_hash_mismatches({**hashes, "t.weight": "0" * 32}) == (1, ["t.weight"])


def test_flat_storage_addresses_views():
    base = torch.arange(12, dtype=torch.float32)
    view = base[4:].view(2, 4)
    flat = flat_storage(view)
    assert flat.numel() == 12 and flat[view.storage_offset()] == 4


def test_unmappable_tensor_is_served_by_replaying_its_loader(tmp_path):
    old = random_checkpoint(0)
    new = perturbed(old, ["scaled.weight", "q.weight"], seed=4)
    m = loaded(old)
    applier = DeltaApplier(m, CHECKPOINT, read=old.__getitem__)  # the checkpoint, for the replay's shadow
    staged = applier.prepare(
        write_delta(tmp_path / "d", old, new, encoding="indices"),
        version=1,
        base_version=0,
        current_version=0,
    )
    assert staged.fallback_names == ["scaled.weight"]
    applier.commit(staged)
    want = loaded(new)
    for n, p in m.named_parameters():
        assert torch.equal(p.view(torch.uint8), getattr(want, n).view(torch.uint8)), n


def test_unmappable_tensor_without_a_checkpoint_to_replay_is_refused(tmp_path):
    old = random_checkpoint(0)
    new = perturbed(old, ["scaled.weight"], seed=5)
    applier = DeltaApplier(loaded(old), CHECKPOINT)
    with pytest.raises(IncompatibleDeltaError, match="no checkpoint to replay"):
        applier.prepare(
            write_delta(tmp_path / "d", old, new, encoding="ulp_zstd"),
            version=1,
            base_version=0,
            current_version=0,
        )


class LocalWorker(DeltaWorkerExtension):
    """The worker extension on a plain module, as vLLM's worker would carry it."""

    def __init__(self, model: nn.Module, model_dir) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir)))
        self.rank = 0
