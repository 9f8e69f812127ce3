"""The device decode of block-indexed batches (wire/batch_device.py) against the host's per-param path.

Why on the CPU: CI has no GPU; a `Decoder` naming the CPU as the device runs the very torch
ops a GPU would, so the two decoders compare bit for bit. The reference is the per-param numpy
path (flush._decode_blocked), never the device code. On `meta` (tests/engine/test_device_decode.py)
the whole prepare shows where each op ran and what crossed.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_batch import _Z, DAMAGE, SMALL_BLOCKS, _retouched, model, per_param_path, same, step, write

from vllm_delta.wire import (
    CorruptDeltaError,
    DeltaWriter,
    Limits,
    batch,
    bytes_digest,
    flush,
    iter_delta,
    open_delta,
)
from vllm_delta.wire.batch_device import Decoder
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import pack, unpack

CPU = torch.device("cpu")
ENCODINGS = ["ulp_zstd", "planes_zstd", "deltas_zstd"]  # every encoding with gaps and value planes/words
RANGES = {
    "big": [(100, 900), (2000, 2100), (3000, 4095)],
    "e0": [],
    "e1": [(0, 40)],
    "norm": None,
    **{f"e{i}": [(64 * i, 511)] for i in range(2, 12)},
}  # one range, several, none, and a param whole


def on_device(path, owned=None, names=None) -> tuple[list, Decoder]:
    """Decoded with every param (or `names`) placed on the CPU "device"; the checks verified."""
    info = open_delta(path)
    dest = Decoder({p.name: CPU for p in info.manifest.params if names is None or p.name in names})
    with pytest.MonkeyPatch.context() as m:  # the device decoder, and it alone
        m.setattr(flush, "plan_blocked", lambda *a, **k: pytest.fail("fell back to the per-param path"))
        out = list(iter_delta(info, current_version=0, owned=owned, lazy=True, decoder=dest))
    dest.verify()
    return out, dest


def host(path, owned=None) -> list:
    with pytest.MonkeyPatch.context() as m:
        per_param_path(m)
        return list(iter_delta(open_delta(path), current_version=0, owned=owned, lazy=True))


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("density", [0.02, 0.3])
@pytest.mark.parametrize("owned", [None, RANGES], ids=["all", "ranges"])
def test_device_decode_equals_the_per_param_path(tmp_path, encoding, density, owned):
    """Blocks of 8-64 entries (chunk edges inside every param), runs restarting after skipped blocks,
    bf16 and float32 params in one batch, steps of 1-3 ULP (escapes)."""
    old = model(12)
    new = step(old, density, seed=1)
    path = write(tmp_path / "d", old, new, encoding)
    dev, dest = on_device(path, owned)
    ref = host(path, owned)
    assert len(dev) == len(ref) == len(new) and dest.checks
    for a, b in zip(dev, ref):
        same(a, b)
    if owned is not None:
        assert any(d.skipped for d in dev) and {d.name: d.count for d in dev}["e0"] == 0


def test_mixed_gap_widths_wide_escapes_and_a_param_past_a_batch(tmp_path, monkeypatch):
    """Gaps of 1, 2, 4 and 8 bytes and escapes of every byte width, in one batch; and with small
    batches, a param larger than a batch decoded on the device as a batch of its own."""
    g = torch.Generator().manual_seed(7)
    shapes = {"u8": (1 << 16,), "u16": (1 << 24,), "u32": (1 << 40,), "u64": (1 << 61,), "f32": (1 << 12,)}
    gaps = {"u8": 200, "u16": 60_000, "u32": 1 << 30, "u64": 1 << 53, "f32": 9}
    with DeltaWriter(
        tmp_path / "d", version=1, base_version=0, encoding="ulp_zstd", block_policy=SMALL_BLOCKS
    ) as w:
        for name, shape in shapes.items():
            pos = torch.cumsum(torch.randint(1, gaps[name], (150,), generator=g), 0)
            dtype = torch.float32 if name == "f32" else torch.bfloat16
            view = torch.int32 if name == "f32" else torch.int16
            old = torch.randn(150, generator=g).to(dtype)
            sign = 1 - 2 * torch.randint(0, 2, (150,), generator=g, dtype=view)
            step_ = torch.randint(1, 4, (150,), generator=g, dtype=view) * sign
            step_[::7] = torch.tensor(1 << 20 if name == "f32" else 9000, dtype=view)  # 3- and 2-byte escapes
            new = (old.view(view) + step_).view(dtype)
            w.add(name, pos, new, old, shape=shape)
    for entries in (batch.DEVICE_BATCH_ENTRIES, 100):
        monkeypatch.setattr(batch, "DEVICE_BATCH_ENTRIES", entries)
        dev, dest = on_device(tmp_path / "d")
        for a, b in zip(dev, host(tmp_path / "d"), strict=True):
            same(a, b)
        assert len(dest.checks) == (1 if entries > 1000 else len(shapes))


def test_positions_past_2_to_the_31_32_and_33(tmp_path):
    """A [2^23 + 2, 2^10] tensor (2^33 + 2^11 elements, written as positions alone) changed at the
    int32 and uint32 edges: the cumsum runs in int64 on the device, a rank owning the upper half too."""
    numel = ((1 << 23) + 2) << 10
    edges = [
        0,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        (1 << 32) + 1,
        (1 << 33) - 1,
        1 << 33,
        numel - 1,
    ]
    pos = torch.tensor(edges)
    old = torch.zeros(len(edges), dtype=torch.bfloat16)
    with DeltaWriter(
        tmp_path / "d",
        version=1,
        base_version=0,
        encoding="ulp_zstd",
        block_policy=Policy(span_bits=6, min_entries=8, max_entries=8),
    ) as w:
        w.add("w", pos, (old.view(torch.int16) + 1).view(torch.bfloat16), old, shape=(numel >> 10, 1 << 10))
    for owned in (None, {"w": [(1 << 32, numel - 1)]}):
        dev, _ = on_device(tmp_path / "d", owned)
        ref = host(tmp_path / "d", owned)
        same(dev[0], ref[0])
    assert torch.equal(on_device(tmp_path / "d")[0][0].positions, pos)


def test_only_the_named_params_decode_on_the_device(tmp_path):
    old = model(4)
    path = write(tmp_path / "d", old, step(old, 0.3, seed=2), "ulp_zstd")
    dev, dest = on_device(path, names={"e1", "e2", "big"})
    for a, b in zip(dev, host(path), strict=True):
        same(a, b)
    assert len(dest.checks) == 1  # one batch: its device params decoded together, its host params apart


@pytest.mark.parametrize(
    "stream,frame",
    [
        ("pos0", lambda n: _Z.compress(b"\xff" * n)),  # gaps past the block index's last position
        ("pos0", lambda n: _Z.compress(b"\0" * n)),  # positions short of it
        ("flag", lambda n: _Z.compress(b"\xff" * n)),  # more flags than the escape planes hold
        ("sign", DAMAGE["trailing bytes"]),  # a frame the host's checks refuse: the per-param path's error
    ],
)
def test_bytes_that_disagree_with_the_block_index_fail_before_use(tmp_path, stream, frame):
    old = model(6)
    path = write(tmp_path / "d", old, step(old, 0.3, seed=3), "ulp_zstd")
    _retouched(path, "e3", stream, frame)
    with pytest.raises(CorruptDeltaError) as host_error:
        host(path)
    dest = Decoder({f"e{i}": CPU for i in range(6)} | {"norm": CPU, "big": CPU})
    with pytest.raises(CorruptDeltaError) as device_error:
        list(iter_delta(open_delta(path), current_version=0, lazy=True, decoder=dest))
        dest.verify()
    assert host_error.value.param == "e3" and device_error.value.param in {"e0", "e3"}


def test_gaps_that_wrap_past_2_to_the_64_back_onto_the_index_fail(tmp_path):
    """Eight gaps of 2^61 - 1 in a 2^61-element tensor run the position round 2^64 back to 0, so the
    block index's first and last still match: only each position's range check sees it."""
    numel = 1 << 61
    gaps = [0] + [numel - 1] * 8 + [99]  # positions 0, 2^61, ..., 7 * 2^61, 2^64 = 0, then 100
    pos = torch.tensor(
        [0, 1 << 58, *(range((1 << 58) + 1, (1 << 58) + 8)), 100 + (1 << 59)]
    )  # width 8, 10 entries
    old = torch.zeros(pos.numel(), dtype=torch.bfloat16)
    with DeltaWriter(tmp_path / "d", version=1, base_version=0, encoding="ulp_zstd") as w:
        w.add("w", pos, (old.view(torch.int16) + 1).view(torch.bfloat16), old, shape=(numel,))
    planes = torch.tensor(gaps, dtype=torch.int64).numpy().view("u1").reshape(-1, 8)
    for j in range(8):
        _retouched(tmp_path / "d", "w", f"pos{j}", lambda n, j=j: _Z.compress(planes[:, j].tobytes()))
    _reindexed(tmp_path / "d", first=0, last=100)
    with pytest.raises(CorruptDeltaError):
        host(tmp_path / "d")
    with pytest.raises(CorruptDeltaError):
        on_device(tmp_path / "d")


def _reindexed(path, *, first: int, last: int) -> None:
    """Give the flush's one param one block from `first` to `last` (and re-sign the manifest)."""
    name = open_delta(path).manifest.files[0].name
    tensors, meta = unpack((path / name).read_bytes(), file=name, limits=Limits())
    params = json.loads(meta["params"])
    params[0]["blocks"][0][0], params[0]["blocks"][0][1] = first, last
    data = pack({k: bytes(t.data) for k, t in tensors.items()}, dict(meta, params=json.dumps(params)))
    (path / name).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=bytes_digest(data))
    (path / "manifest.json").write_text(json.dumps(m))
