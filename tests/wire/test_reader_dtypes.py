"""Every dtype check of the readers, in-process: each refusal with its own error type.

Covered elsewhere, so not repeated: an unknown dtype in the manifest and a safetensors dtype code
the container does not know (test_corrupt.py), and the caller's model disagreeing with the
manifest's dtype (test_corrupt.py::test_model_mismatches_are_422). Here: the flush header's own
dtype (unknown, or other than the manifest's or the model's), stream tensors that are not uint8,
the seed layout's dtype rules (uint8 positions, narrowing promoted values only where exact),
HF checkpoints holding a dtype the codec cannot carry, receiver-side resolve/apply, and the lookups.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from wire_helpers import seed_flush_bytes, write_delta

from vllm_delta.wire import (
    DtypeMismatchError,
    FormatError,
    UnknownDtypeError,
    bytes_digest,
    read_delta,
    write_manifest,
)
from vllm_delta.wire.checkpoint import Checkpoint
from vllm_delta.wire.codecs import ulp_resolve_tensor
from vllm_delta.wire.container import Limits, unpack
from vllm_delta.wire.dtypes import by_name, by_st_code, by_torch
from vllm_delta.wire.manifest import load_manifest

F = "rank0000_flush000000.safetensors"
SHAPE = (4, 8)


def delta(tmp_path: Path, *, encoding: str = "indices", blocked: bool = True) -> tuple[Path, torch.Tensor]:
    """A one-flush delta of bf16 param `w` with every 3rd element one bit pattern up."""
    old = (torch.arange(32, dtype=torch.int16) + 0x3F00).view(torch.bfloat16).reshape(SHAPE)
    new = old.clone()
    new.view(-1).view(torch.int16)[::3] += 1
    return write_delta(tmp_path / "d", {"w": old}, {"w": new}, encoding=encoding, blocked=blocked), old


def rewrite_flush(d: Path, *, dtype: str | None = None, stream_dtype: str | None = None) -> None:
    """Re-save the flush with its header's dtype of `w`, or its `values` stream's tensor dtype,
    changed, and re-sign the manifest (as a sender that controls both could)."""
    tensors, meta = unpack((d / F).read_bytes(), file=F, limits=Limits())
    arrays = {k: np.frombuffer(t.data, dtype=np.uint8) for k, t in tensors.items()}
    if dtype is not None:
        params = json.loads(meta["params"])
        params[0]["dtype"] = dtype
        meta = dict(meta, params=json.dumps(params))
    if stream_dtype is not None:
        arrays["__values__"] = arrays["__values__"].view(stream_dtype)
    data = safetensors.numpy.save(arrays, metadata=meta)
    (d / F).write_bytes(data)
    m = load_manifest(d)
    write_manifest(
        d,
        m.model_copy(
            update={"files": [m.files[0].model_copy(update={"bytes": len(data), "hash": bytes_digest(data)})]}
        ),
    )


@pytest.mark.parametrize("blocked", [True, False], ids=["v2", "v1"])
def test_unknown_dtype_in_the_flush_header(tmp_path, blocked):
    d, _ = delta(tmp_path, blocked=blocked)
    rewrite_flush(d, dtype="float128")
    with pytest.raises(UnknownDtypeError) as e:
        read_delta(d, current_version=0)
    assert e.value.param == "w" and e.value.file == F and e.value.http_status == 422


@pytest.mark.parametrize("blocked", [True, False], ids=["v2", "v1"])
def test_flush_header_dtype_other_than_the_manifests(tmp_path, blocked):
    # float16 has bf16's width, so the data still decodes: only the dtype checks can tell.
    d, _ = delta(tmp_path, blocked=blocked)
    rewrite_flush(d, dtype="float16")
    with pytest.raises(DtypeMismatchError) as e:  # against the model, as the flush is opened
        read_delta(d, current_version=0, expected={"w": (SHAPE, torch.bfloat16)})
    assert e.value.param == "w" and e.value.file == F
    with pytest.raises(FormatError, match="dtype differs from the manifest"):  # no model given
        read_delta(d, current_version=0)


@pytest.mark.parametrize("blocked", [True, False], ids=["v2", "v1"])
def test_stream_tensor_that_is_not_uint8(tmp_path, blocked):
    d, _ = delta(tmp_path, blocked=blocked)
    rewrite_flush(d, stream_dtype="<i2")  # same bytes, stored as an int16 tensor
    with pytest.raises(FormatError, match="not a 1-D uint8 tensor"):
        read_delta(d, current_version=0)


def test_resolve_and_apply_refuse_another_dtype(tmp_path):
    d, old = delta(tmp_path, encoding="ulp_zstd")
    (pd,) = read_delta(d, current_version=0)
    at = old.reshape(-1)[pd.positions]
    with pytest.raises(ValueError, match="resolve needs"):
        pd.resolve(at.float())
    with pytest.raises(ValueError, match="target must be"):
        pd.apply_(old.float())
    with pytest.raises(ValueError, match="steps"):  # steps of another width than the values
        ulp_resolve_tensor(at, pd.values.to(torch.int32))
    with pytest.raises(UnknownDtypeError):
        ulp_resolve_tensor(at.to(torch.complex64), pd.values)


# ---- the seed's layout ----------------------------------------------------------------------


def seed_pair(dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    old = torch.ones(64, dtype=dtype)
    new = old.clone()
    new[[2, 40]] = torch.tensor([0.5, -3.0], dtype=dtype)
    return [("w", old, new)]


def resave_seed(
    data: bytes,
    *,
    params: list | None = None,
    values: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> bytes:
    """A seed flush with fields replaced, its checksum recomputed by `torch.hash_tensor` (the seed's)."""
    tensors = safetensors.torch.load(data)
    meta = unpack(data, file=F, limits=Limits())[1]
    if values is not None:
        tensors["__values__"] = values
    if positions is not None:
        tensors["__positions__"] = positions
    pos, vals = tensors["__positions__"], tensors["__values__"]
    checksum = torch.hash_tensor(pos).item() ^ ((torch.hash_tensor(vals).item() << 1) & ((1 << 64) - 1))
    meta = dict(
        meta, checksum=str(checksum), **({"params": json.dumps(params)} if params is not None else {})
    )
    return safetensors.torch.save(tensors, metadata=meta)


def read_seed(tmp_path: Path, data: bytes, **kw):
    (tmp_path / F).write_bytes(data)
    return read_delta(tmp_path, allow_seed=True, **kw)


def test_seed_positions_must_be_uint8(tmp_path):
    data = seed_flush_bytes(seed_pair(), encoding="indices")
    pos = safetensors.torch.load(data)["__positions__"]
    with pytest.raises(FormatError, match="uint8"):
        read_seed(tmp_path, resave_seed(data, positions=pos.view(torch.int32)))


def test_seed_param_of_an_unknown_dtype(tmp_path):
    data = seed_flush_bytes(seed_pair())
    params = json.loads(unpack(data, file=F, limits=Limits())[1]["params"])
    params[0]["dtype"] = "torch.float128"
    with pytest.raises(UnknownDtypeError) as e:
        read_seed(tmp_path, resave_seed(data, params=params))
    assert e.value.param == "w"


def test_seed_param_dtype_other_than_the_models(tmp_path):
    data = seed_flush_bytes(seed_pair())
    (tmp_path / F).write_bytes(data)
    with pytest.raises(DtypeMismatchError) as e:
        read_delta(tmp_path, allow_seed=True, expected={"w": ((64,), torch.float16)})
    assert e.value.param == "w" and e.value.http_status == 422


@pytest.mark.parametrize(
    "dtype,inexact",
    [
        (torch.bfloat16, 0x3F800001),  # 1 + 2^-23: low 16 bits set, no bf16 holds it (checked bitwise)
        (torch.float16, 0x3DCCCCCD),  # 0.1f: 23 mantissa bits, fp16 has 10 (checked by a round trip)
    ],
)
def test_seed_promoted_values_narrow_only_where_exact(tmp_path, dtype, inexact):
    data = seed_flush_bytes(seed_pair(dtype), promote=True)
    vals = safetensors.torch.load(data)["__values__"]
    assert vals.dtype == torch.float32
    (pd,) = read_seed(tmp_path, data)  # exact: narrowed back to the param's dtype
    assert pd.dtype == dtype and pd.values.tolist() == [0.5, -3.0]
    bad = vals.clone()
    bad.view(torch.int32)[1] = inexact
    with pytest.raises(FormatError, match=f"not exact in {str(dtype)[6:]}") as e:
        read_seed(tmp_path, resave_seed(data, values=bad))
    assert e.value.param == "w"


# ---- checkpoints and lookups ----------------------------------------------------------------


def test_checkpoint_with_a_dtype_the_codec_cannot_carry(tmp_path):
    ok = {"w": torch.ones(4, dtype=torch.bfloat16), "s": torch.ones(2, dtype=torch.float8_e4m3fn)}
    safetensors.torch.save_file(ok, str(tmp_path / "model.safetensors"))
    assert Checkpoint.open(tmp_path).meta == {"w": ((4,), torch.bfloat16), "s": ((2,), torch.float8_e4m3fn)}
    safetensors.torch.save_file(
        {"mask": torch.zeros(3, dtype=torch.bool)}, str(tmp_path / "model-2.safetensors")
    )
    with pytest.raises(UnknownDtypeError, match="BOOL"):
        Checkpoint.open(tmp_path)


def test_dtype_lookups_refuse_what_they_do_not_know():
    assert by_name("torch.bfloat16") is by_name("bfloat16")  # the seed's spelling
    for bad in ("float128", "torch.float128", "BF16", "", 5, None):
        with pytest.raises(UnknownDtypeError):
            by_name(bad)
    for bad in (torch.bool, torch.complex64, torch.uint16):
        with pytest.raises(UnknownDtypeError):
            by_torch(bad)
    for bad in ("BOOL", "bfloat16", "U16"):
        with pytest.raises(UnknownDtypeError):
            by_st_code(bad)
