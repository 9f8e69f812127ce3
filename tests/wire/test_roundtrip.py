"""Round trips: every encoding, bit-exact, over dtypes, shapes, densities and special values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_helpers import write_delta

from vllm_delta.diff import diff_param
from vllm_delta.wire import (
    ENCODINGS,
    DeltaDecoder,
    DeltaWriter,
    Manifest,
    ParamChange,
    ParamEntry,
    VersionError,
    encode_flush,
    file_entry,
    get_encoding,
    open_delta,
    read_delta,
    tensor_digest,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
SPECIAL_BITS = {  # +0, -0, +inf, -inf, quiet NaN, NaN with a payload, negative NaN, smallest denormal
    torch.int16: [0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, -0x003F, 0x0001],
    torch.int32: [0, -0x80000000, 0x7F800000, -0x00800000, 0x7FC00000, 0x7F800123, -0x003FFFFF, 1],
}


def roundtrip(
    encoding: str, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Encode to flush bytes and decode them as a collective receiver would; returns applied tensors."""
    enc = get_encoding(encoding)
    changes, entries = [], []
    for name, t in new.items():
        d = diff_param(t, old[name])
        if d.positions.numel():
            changes.append(ParamChange(name, tuple(t.shape), d.positions, d.new_values, d.old_values))
            entries.append(
                ParamEntry(
                    name=name,
                    dtype=str(t.dtype)[6:],
                    shape=list(t.shape),
                    changed=d.positions.numel(),
                    files=["f0"],
                )
            )
    flush = encode_flush(changes, encoding=enc, version=2, base_version=1)
    manifest = Manifest(
        version=2,
        base_version=1,
        encoding=encoding,
        files=[file_entry("f0", flush)] if changes else [],
        params=entries,
    )
    out = {k: v.clone() for k, v in old.items()}
    dec = DeltaDecoder(manifest, expected={k: (v.shape, v.dtype) for k, v in old.items()}, current_version=1)
    if changes:
        for pd in dec.feed("f0", flush.data):
            assert pd.positions.dtype == torch.int64
            assert pd.values.element_size() == new[pd.name].element_size()  # never promoted
            pd.apply_(out[pd.name])
    dec.finish()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(INT[a.dtype]), b.reshape(-1).view(INT[b.dtype])
    )


@st.composite
def param_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=0, max_size=3)))
    numel = int(np.prod(shape, dtype=np.int64))
    ity = INT[dtype]
    lo, hi = torch.iinfo(ity).min, torch.iinfo(ity).max
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    old_bits = torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(ity)
    mode = draw(st.sampled_from(["none", "one", "all", "some"]))
    mask = {
        "none": torch.zeros(numel, dtype=torch.bool),
        "all": torch.ones(numel, dtype=torch.bool),
        "one": torch.arange(numel) == draw(st.integers(0, max(numel - 1, 0))),
        "some": torch.rand(numel, generator=g) < draw(st.floats(0.01, 0.9)),
    }[mode]
    new_bits = old_bits.clone()
    kind = draw(st.sampled_from(["ulp", "random", "special"]))
    k = int(mask.sum())
    if kind == "ulp":
        new_bits[mask] = old_bits[mask] + torch.randint(-3, 4, (k,), generator=g).to(ity).clamp_min(1)
    elif kind == "random":
        new_bits[mask] = torch.randint(lo, hi, (k,), generator=g, dtype=torch.int64).to(ity)
    else:
        sp = torch.tensor(SPECIAL_BITS[ity], dtype=torch.int64)
        new_bits[mask] = sp[torch.randint(0, len(sp), (k,), generator=g)].to(ity)
    return old_bits.view(dtype).reshape(shape), new_bits.view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(param_pairs(), min_size=1, max_size=3), encoding=st.sampled_from(sorted(ENCODINGS)))
def test_roundtrip_is_bit_exact(pairs, encoding):
    old = {f"p{i}": o for i, (o, _) in enumerate(pairs)}
    new = {f"p{i}": n for i, (_, n) in enumerate(pairs)}
    out = roundtrip(encoding, old, new)
    for name in new:
        assert same_bits(out[name], new[name]), name


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_zero_and_nan_payloads_roundtrip_through_a_directory(tmp_path, encoding):
    old = torch.zeros(16, dtype=torch.bfloat16)
    new = old.clone()
    nb = new.view(torch.int16)
    nb[1] = -0x8000  # -0.0
    nb[3] = 0x7F81  # NaN with a payload
    nb[15] = -0x3F  # negative NaN
    same = torch.ones(4)
    write_delta(tmp_path / "d", {"w": old, "same": same}, {"w": new, "same": same.clone()}, encoding=encoding)
    info = open_delta(tmp_path / "d")
    assert [p.name for p in info.manifest.params] == ["w"]  # zero-change params write nothing
    out = old.clone()
    for pd in read_delta(tmp_path / "d", current_version=0):
        pd.apply_(out)
    assert same_bits(out, new)
    assert tensor_digest(out) == info.manifest.params[0].post_hash


def test_no_changes_write_no_files(tmp_path):
    t = torch.randn(8)
    write_delta(tmp_path / "d", {"t": t}, {"t": t.clone()})
    m = open_delta(tmp_path / "d").manifest
    assert m.files == [] and m.params == []
    assert read_delta(tmp_path / "d", current_version=0) == []


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_positions_past_2_pow_31_without_allocating(encoding):
    shape = (1 << 17, 1 << 16)  # 2^33 elements, never materialized
    pos = torch.tensor([0, 5, (1 << 31) - 1, 1 << 31, (1 << 32) + 7, (1 << 33) - 1], dtype=torch.int64)
    old = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, -0.0], dtype=torch.bfloat16)
    new = torch.tensor([1.5, -2.5, 0.25, 3.5, -0.0, 7.0], dtype=torch.bfloat16)
    enc = get_encoding(encoding)
    flush = encode_flush([ParamChange("huge", shape, pos, new, old)], encoding=enc, version=1, base_version=0)
    m = Manifest(
        version=1,
        base_version=0,
        encoding=encoding,
        files=[file_entry("f", flush)],
        params=[ParamEntry(name="huge", dtype="bfloat16", shape=list(shape), changed=6, files=["f"])],
    )
    (pd,) = DeltaDecoder(m, current_version=0).feed("f", flush.data)
    assert torch.equal(pd.positions, pos)
    assert same_bits(pd.resolve(old), new)


def test_big_params_split_into_ordered_chunks_across_flushes(tmp_path):
    old = torch.randn(5000)
    new = old.clone()
    new[::3] += 1.0
    write_delta(tmp_path / "d", {"w": old}, {"w": new}, flush_bytes=4096)
    m = open_delta(tmp_path / "d").manifest
    assert len(m.files) > 3 and m.params[0].files == [f.name for f in m.files]
    out = old.clone()
    deltas = read_delta(tmp_path / "d", current_version=0)
    assert len(deltas) == len(m.files)
    for pd in deltas:
        pd.apply_(out)
    assert same_bits(out, new)


def test_base_relative_encoding_enforces_base_version(tmp_path):
    old = torch.randn(10).bfloat16()
    new = old.clone()
    new[2] = 1.0
    write_delta(tmp_path / "d", {"w": old}, {"w": new}, version=8, base_version=7)
    with pytest.raises(VersionError) as e:
        read_delta(tmp_path / "d", current_version=6)
    assert e.value.http_status == 409
    with pytest.raises(ValueError):
        DeltaWriter(tmp_path / "e", version=1, base_version=None, encoding="ulp_zstd")


def test_overwrite_encodings_are_idempotent(tmp_path):
    """Applied twice, an overwrite delta leaves the new weights and a base-relative one moves them
    twice. The reference is plain torch on the inputs, not the encodings' own flags (both of which
    derive from one field): every changed value moves one bit pattern up, so twice is two up."""
    base_relative = {"ulp_zstd"}  # docs/wire-format.md: values are steps from the receiver's bits
    old = (torch.rand(100) + 0.5).bfloat16()  # positive and finite: a bit pattern up is a value up
    new, twice = old.clone(), old.clone()
    new.view(torch.int16)[::7] += 1
    twice.view(torch.int16)[::7] += 2
    for encoding, enc in ENCODINGS.items():
        write_delta(tmp_path / encoding, {"w": old}, {"w": new}, encoding=encoding)
        out = old.clone()
        for _ in range(2):
            for pd in read_delta(tmp_path / encoding, current_version=0):
                pd.apply_(out)
        assert same_bits(out, twice if encoding in base_relative else new), encoding
        assert (enc.idempotent, enc.needs_base) == (encoding not in base_relative, encoding in base_relative)


def test_best_encoding_is_smallest_on_adam_like_changes(tmp_path):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(200_000, generator=g) * 0.02
    old = master.bfloat16()
    new = (master - 1e-6 * torch.randn(200_000, generator=g).sign() * 50).bfloat16()
    sizes = {e: write_delta(tmp_path / e, {"w": old}, {"w": new}, encoding=e) for e in ENCODINGS}
    nbytes = {e: open_delta(p).manifest.total_bytes for e, p in sizes.items()}
    assert min(nbytes, key=nbytes.get) == "ulp_zstd"
    assert nbytes["planes_zstd"] < nbytes["deltas_zstd"] < nbytes["deltas"]


def test_order_key_is_a_monotone_bijection_on_bf16():
    from vllm_delta.wire.codecs import from_order_key, order_key
    from vllm_delta.wire.dtypes import by_name

    d = by_name("bfloat16")
    bits = np.arange(1 << 16, dtype=np.uint16)
    key = order_key(bits, d)
    assert np.array_equal(from_order_key(key, d), bits)
    assert np.unique(key).size == bits.size
    vals = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    finite = ~np.isnan(vals)
    by_key = vals[finite][np.argsort(key[finite])]
    assert np.all(np.diff(by_key) >= 0)  # sorting by key sorts by value (-0 just below +0)
