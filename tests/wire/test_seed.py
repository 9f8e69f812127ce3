"""Seed-format deltas (no manifest) written by a test-side writer that follows the documented layout."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from wire_helpers import seed_flush_bytes

from vllm_delta.wire import IncompleteDeltaError, IntegrityError, Limits, open_delta, read_delta
from vllm_delta.wire.container import unpack

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def pair():
    g = torch.Generator().manual_seed(3)
    a_old = (torch.randn(40, 8, generator=g) * 0.02).bfloat16()
    a_new = a_old.clone()
    a_new.view(-1)[[0, 1, 17, 300, 319]] = torch.tensor([0.5, -0.0, float("nan"), 1e-3, -2.0]).bfloat16()
    b_old = torch.randn(70_000, generator=g)  # a gap above 65535 forces uint32 gaps
    b_new = b_old.clone()
    b_new[[3, 69_999]] = torch.tensor([-0.0, 7.0])
    return [("a", a_old, a_new), ("b", b_old, b_new)]


@pytest.mark.parametrize("encoding", ["indices", "deltas", "deltas_zstd"])
@pytest.mark.parametrize("promote", [False, True])
def test_seed_directory_without_manifest_is_a_valid_delta(tmp_path, encoding, promote):
    changes = pair()
    d = tmp_path / "weight_v000004"
    d.mkdir()
    (d / "rank0000_flush000000.safetensors").write_bytes(
        seed_flush_bytes(changes[:1], encoding=encoding, version=4, promote=promote)
    )
    (d / "rank0001_flush000000.safetensors").write_bytes(
        seed_flush_bytes(changes[1:], encoding=encoding, version=4, promote=promote)
    )
    info = open_delta(d, allow_seed=True)
    assert info.seed and info.manifest.version == 4 and info.manifest.changed == 7
    out = {name: old.clone() for name, old, _ in changes}
    for pd in read_delta(d, allow_seed=True, expected={k: (v.shape, v.dtype) for k, v in out.items()}):
        assert pd.dtype == out[pd.name].dtype  # promoted fp32 values come back as bf16, exactly
        pd.apply_(out[pd.name])
    for name, _, new in changes:
        assert torch.equal(out[name].view(INT[new.dtype]), new.view(INT[new.dtype]))


def test_explicit_file_list_from_the_push(tmp_path):
    changes = pair()
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(seed_flush_bytes(changes, version=2))
    (tmp_path / "rank0000_flush000001.safetensors").write_bytes(b"half-written junk")
    deltas = read_delta(tmp_path, allow_seed=True, files=["rank0000_flush000000.safetensors"])
    assert sorted(pd.name for pd in deltas) == ["a", "b"]


def test_seed_checksum_mismatch(tmp_path):
    data = bytearray(seed_flush_bytes(pair(), encoding="deltas"))
    data[-1] ^= 0x01  # last value byte: the container stays valid, the checksum does not
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="seed checksum"):
        open_delta(tmp_path, allow_seed=True)


def test_a_seed_delta_is_read_only_where_allowed(tmp_path):
    """Manifest-less files are refused unless the caller allows the seed's format (the engine's
    --delta-updates-allow-seed-format): its checksum misses swapped values and renamed params."""
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(seed_flush_bytes(pair(), version=2))
    with pytest.raises(IncompleteDeltaError, match="allow-seed-format"):
        open_delta(tmp_path)
    with pytest.raises(IncompleteDeltaError, match="allow-seed-format"):
        read_delta(tmp_path)
    assert open_delta(tmp_path, allow_seed=True).seed


def test_what_the_seed_checksum_cannot_catch(tmp_path):
    """Why it is opt-in (docs/wire-format.md): two values swapped, or a param renamed, still pass."""
    changes = pair()
    data = seed_flush_bytes(changes, encoding="deltas")
    tensors, meta = unpack(data, file=None, limits=Limits())
    values = bytearray(tensors["__values__"].data)
    w = tensors["__values__"].dtype.itemsize
    values[:w], values[w : 2 * w] = values[w : 2 * w], values[:w]  # the first two values swapped
    params = json.loads(meta["params"])
    params[0]["name"] = "renamed"
    meta["params"] = json.dumps(params)
    forged = safetensors.torch.save(
        {
            "__positions__": torch.frombuffer(bytearray(tensors["__positions__"].data), dtype=torch.uint8),
            "__values__": torch.frombuffer(values, dtype=tensors["__values__"].dtype.torch),
        },
        metadata=meta,
    )
    for name, blob in (("true", data), ("forged", forged)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0000_flush000000.safetensors").write_bytes(blob)
    true = {pd.name: pd for pd in read_delta(tmp_path / "true", allow_seed=True)}
    got = {pd.name: pd for pd in read_delta(tmp_path / "forged", allow_seed=True)}  # no error
    a, b = true["a"].values[:2].view(torch.int16).tolist()
    assert "a" not in got and got["renamed"].values[:2].view(torch.int16).tolist() == [b, a] and a != b
