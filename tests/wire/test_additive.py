"""The additive digest: equal to a plain-Python reference, O(changed) updates, shards that add up."""

from __future__ import annotations

import pytest
import torch

from vllm_delta.wire import additive
from vllm_delta.wire.manifest import FileEntry, Manifest, ParamEntry, merge_manifests

M64 = (1 << 64) - 1
LANES = [
    (0x9E3779B97F4A7C15, (30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)),
    (0xC2B2AE3D27D4EB4F, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)),
]


def _ref_mix(x: int, shifts, mults) -> int:
    x = ((x ^ (x >> shifts[0])) * mults[0]) & M64
    x = ((x ^ (x >> shifts[1])) * mults[1]) & M64
    return x ^ (x >> shifts[2])


def _reference(t: torch.Tensor) -> str:
    """The spec in unsigned Python integers, written independently of the torch code: key =
    i * 2^width + bits (up to 32-bit dtypes) or mix0(i * g0 + g0) ^ bits; lane 0 = mix0(key),
    lane 1 = mix1(key ^ g1)."""
    width = t.element_size() * 8
    raw = (
        t.reshape(-1)
        .view({8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width])
        .tolist()
    )
    sums = [0, 0]
    for i, b in enumerate(raw):
        bits = b & ((1 << width) - 1)
        if width <= 32:
            key = (i << width) | bits
        else:
            key = _ref_mix((i * LANES[0][0] + LANES[0][0]) & M64, LANES[0][1], LANES[0][2]) ^ bits
        sums[0] = (sums[0] + _ref_mix(key, LANES[0][1], LANES[0][2])) & M64
        sums[1] = (sums[1] + _ref_mix(key ^ LANES[1][0], LANES[1][1], LANES[1][2])) & M64
    return f"{sums[0]:016x}{sums[1]:016x}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8])
def test_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(7, 13, generator=g) * 100).to(dtype)
    assert additive.to_hex(additive.tensor_sum(t, chunk=17)) == _reference(t)


def test_update_in_o_changed_equals_full_rehash() -> None:
    g = torch.Generator().manual_seed(2)
    old = torch.randn(5000, generator=g).to(torch.bfloat16)
    new = old.clone()
    pos = torch.tensor([3, 99, 4000])
    new[pos] = torch.tensor([1.0, -0.0, float("nan")], dtype=torch.bfloat16)
    updated = additive.combine(
        additive.to_hex(additive.tensor_sum(old)),
        additive.to_hex(additive.partial_sum(pos, new[pos])),
        minus=(additive.to_hex(additive.partial_sum(pos, old[pos])),),
    )
    assert updated == additive.to_hex(additive.tensor_sum(new))
    assert updated != additive.to_hex(additive.tensor_sum(old))


def test_detects_swapped_positions_and_signed_zero() -> None:
    t = torch.tensor([1.0, 2.0, 0.0], dtype=torch.bfloat16)
    swapped = torch.tensor([2.0, 1.0, 0.0], dtype=torch.bfloat16)
    negzero = torch.tensor([1.0, 2.0, -0.0], dtype=torch.bfloat16)
    h = additive.to_hex(additive.tensor_sum(t))
    assert h != additive.to_hex(additive.tensor_sum(swapped))
    assert h != additive.to_hex(additive.tensor_sum(negzero))


def test_meta_tensors_stay_on_meta() -> None:
    out = additive.partial_sum(
        torch.zeros(4, dtype=torch.int64, device="meta"), torch.empty(4, dtype=torch.bfloat16, device="meta")
    )
    assert out.device.type == "meta" and out.shape == (2,)


def _entry(name: str, files: list[str], changed: int, digest: str) -> ParamEntry:
    return ParamEntry(name=name, dtype="bfloat16", shape=[4, 4], changed=changed, files=files, digest=digest)


def test_merge_adds_shard_digests_and_keeps_parts() -> None:
    t = torch.randn(4, 4).to(torch.bfloat16)
    flat = t.reshape(-1)
    lo, hi = torch.arange(0, 6), torch.arange(6, 16)
    parts = [
        Manifest(
            version=1,
            encoding="indices",
            files=[FileEntry(name=f"r{r}", bytes=1, hash="h")],
            params=[_entry("w", [f"r{r}"], len(idx), additive.to_hex(additive.partial_sum(idx, flat[idx])))],
        )
        for r, idx in enumerate((lo, hi))
    ]
    merged = merge_manifests(parts)
    (p,) = merged.params
    assert p.changed == 16 and p.parts == [["r0"], ["r1"]]
    assert p.digest == additive.to_hex(additive.tensor_sum(t))


def test_merge_refuses_whole_tensor_hash_from_two_writers() -> None:
    parts = [
        Manifest(
            version=1,
            encoding="indices",
            files=[FileEntry(name=f"r{r}", bytes=1, hash="h")],
            params=[
                ParamEntry(name="w", dtype="bfloat16", shape=[4], changed=1, files=[f"r{r}"], post_hash="x")
            ],
        )
        for r in range(2)
    ]
    with pytest.raises(ValueError, match="post_hash"):
        merge_manifests(parts)


def test_parts_must_partition_files() -> None:
    with pytest.raises(ValueError, match="partition"):
        ParamEntry(name="w", dtype="bfloat16", shape=[4], changed=1, files=["a", "b"], parts=[["a"]])
