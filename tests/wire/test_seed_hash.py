"""The seed reader checks the seed's real checksum: `torch.hash_tensor(positions) ^ (torch.hash_tensor(values)
<< 1)`.

Why these tests: the checksum was reconstructed once as an XOR of raw 64-bit words, and the tests
built files with that same function, so they could not tell. Here every file's checksum is
computed by `torch.hash_tensor` itself, the way the seed's writer did.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from vllm_delta.diff import diff_param
from vllm_delta.wire import IntegrityError, open_delta, read_delta
from vllm_delta.wire.codecs import encode_gaps
from vllm_delta.wire.dtypes import by_torch
from vllm_delta.wire.seed_format import seed_hash

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def torch_checksum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """The seed's checksum. torch 2.13 has no uint64 `<<` on the CPU, so the shift is taken on the
    unsigned value (`.item()`), modulo 2^64, exactly as a uint64 shift wraps."""
    return torch.hash_tensor(positions).item() ^ ((torch.hash_tensor(values).item() << 1) & ((1 << 64) - 1))


def seed_file(changes: list[tuple[str, torch.Tensor, torch.Tensor]], encoding: str, promote: bool) -> bytes:
    """One flush exactly as the seed wrote it (pos_width 4 for indices, 2 or 4 for deltas)."""
    blobs, vals, params, pos_off, val_off = [], [], [], 0, 0
    for name, old, new in changes:
        d = diff_param(new, old)
        pos = d.positions.numpy()
        if encoding == "indices":
            w, blob = 4, pos.astype("<i4").tobytes()
        else:
            w, gaps = encode_gaps(pos)
            w = max(w, 2)
            blob = gaps.astype(f"<u{w}").tobytes()
        v = d.new_values.float() if promote else d.new_values
        params.append(
            {
                "name": name,
                "dtype": str(new.dtype),
                "shape": list(new.shape),
                "pos_start": pos_off,
                "pos_end": pos_off + len(blob),
                "pos_width": w,
                "val_start": val_off,
                "val_end": val_off + v.numel(),
            }
        )
        blobs.append(blob)
        vals.append(v)
        pos_off, val_off = pos_off + len(blob), val_off + v.numel()
    positions = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    values = torch.cat(vals)
    data = save(
        {"__positions__": positions, "__values__": values},
        metadata={
            "encoding": encoding,
            "params": json.dumps(params),
            "current_version": "3",
            "checksum": str(torch_checksum(positions, values)),
        },
    )
    return zstandard.ZstdCompressor(level=1).compress(data) if encoding == "deltas_zstd" else data


def bf16_changes(promote: bool) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """bf16 params (and one fp32 when promoting, as the seed mixed them); NaN payloads, -0.0, inf."""
    g = torch.Generator().manual_seed(11)
    a_old = (torch.randn(64, 16, generator=g) * 0.02).bfloat16()
    a_new = a_old.clone()
    a_new.view(torch.int16).view(-1)[::7] += 1
    a_new.view(-1)[[0, 1, 2, 3]] = torch.tensor([float("inf"), -0.0, float("nan"), -3.5]).bfloat16()
    a_new.view(torch.int16).view(-1)[5] = 0x7F81  # a NaN with a payload: bf16 -> fp32 keeps its bits
    b_old = (torch.randn(300, generator=g) * 0.02).bfloat16()
    b_new = b_old.clone()
    b_new[[0, 150, 299]] = torch.tensor([1.0, -1.0, 2.0]).bfloat16()
    out = [("a", a_old, a_new), ("b", b_old, b_new)]
    if promote:
        c_old = torch.randn(70_000, generator=g)  # a gap above 65535: uint32 gaps
        c_new = c_old.clone()
        c_new[[3, 69_999]] = torch.tensor([-0.0, 7.0])
        out.append(("c", c_old, c_new))
    return out


@pytest.mark.parametrize("encoding", ["indices", "deltas", "deltas_zstd"])
@pytest.mark.parametrize("promote", [False, True], ids=["bf16-values", "fp32-promoted"])
def test_seed_file_checksummed_by_torch_hash_tensor_is_read(tmp_path, encoding, promote):
    changes = bf16_changes(promote)
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(seed_file(changes, encoding, promote))
    info = open_delta(tmp_path, allow_seed=True)
    assert info.seed and info.manifest.version == 3
    out = {name: old.clone() for name, old, _ in changes}
    for pd in read_delta(tmp_path, allow_seed=True, expected={k: (v.shape, v.dtype) for k, v in out.items()}):
        pd.apply_(out[pd.name])
    for name, _, new in changes:
        assert torch.equal(out[name].view(INT[new.dtype]), new.view(INT[new.dtype])), name


@pytest.mark.parametrize("promote", [False, True], ids=["bf16-values", "fp32-promoted"])
def test_one_flipped_value_bit_fails_the_torch_checksum(tmp_path, promote):
    data = bytearray(seed_file(bf16_changes(promote), "deltas", promote))
    data[-3] ^= 0x10
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="seed checksum") as exc:
        open_delta(tmp_path, allow_seed=True)
    assert exc.value.file == "rank0000_flush000000.safetensors"


def random_bits(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Every bit pattern is fair game: NaNs with payloads, subnormals, -0.0, infinities."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
    ],
)
@pytest.mark.parametrize("n", [1, 7, 4099])  # torch.hash_tensor refuses an empty tensor
def test_seed_hash_equals_torch_hash_tensor(dtype, n):
    t = random_bits(dtype, n, seed=n)
    expected = torch.hash_tensor(t).item()  # a uint64 tensor: .item() is the unsigned value
    assert seed_hash(t.view(torch.uint8).numpy().tobytes(), by_torch(dtype)) == expected


def test_seed_hash_widens_elements_rather_than_xoring_raw_words():
    """The documented example: a uint8 blob hashes its byte values one by one; bf16 1.0 as float64 1.0."""
    assert seed_hash(bytes([1, 2, 3]), by_torch(torch.uint8)) == 1 ^ 2 ^ 3
    one = torch.ones(1, dtype=torch.bfloat16)
    assert seed_hash(one.view(torch.uint8).numpy().tobytes(), by_torch(torch.bfloat16)) == int(
        np.array([1.0]).view(np.uint64)[0]
    )
