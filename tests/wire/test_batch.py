"""The batched decode of block-indexed flushes (wire/batch.py).

It must give exactly the per-param path's deltas, refuse what that path refuses with the same error,
and cost a fixed number of zstd contexts and calls per flush, never per param (issue 16: at 44k
checkpoint tensors a context per frame was most of prepare).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
import zstandard

from vllm_delta.wire import (
    CorruptDeltaError,
    DeltaWriter,
    Limits,
    batch,
    batch_host,
    bytes_digest,
    container,
    flush,
    iter_delta,
    open_delta,
)
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import pack, unpack

SMALL_BLOCKS = Policy(span_bits=6, min_entries=8, max_entries=64)  # several blocks per param


def model(n: int) -> dict[str, torch.Tensor]:
    """`n` small bf16 tensors (expert-like), one float32 vector, one larger bf16 tensor."""
    g = torch.Generator().manual_seed(n)
    out = {f"e{i}": torch.randn(16, 32, generator=g).bfloat16() for i in range(n)}
    out["norm"] = torch.randn(64, generator=g)
    out["big"] = torch.randn(64, 64, generator=g).bfloat16()
    return out


def step(old: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """Bit steps of 1..3 ULP (either sign) at about `density` of the positions (none left unchanged)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in old.items():
        view = {2: torch.int16, 4: torch.int32}[t.element_size()]
        bits = t.reshape(-1).view(view).clone()
        hit = torch.rand(bits.shape, generator=g) < density
        sign = 1 - 2 * torch.randint(0, 2, bits.shape, generator=g, dtype=view)
        move = torch.randint(1, 4, bits.shape, generator=g, dtype=view) * sign
        bits[hit] += move[hit]
        new[name] = bits.view(t.dtype).reshape(t.shape)
    return new


def write(path, old, new, encoding: str, policy: Policy = SMALL_BLOCKS):
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding, block_policy=policy) as w:
        for name, t in new.items():
            a, b = old[name].reshape(-1), t.reshape(-1)
            view = {2: torch.int16, 4: torch.int32}[t.element_size()]
            pos = torch.nonzero(a.view(view) != b.view(view)).squeeze(1)
            if pos.numel():
                w.add(name, pos, b[pos], a[pos], shape=tuple(t.shape))
    return path


def per_param_path(monkeypatch):
    """Send every flush to the per-param path (the reference implementation)."""

    def refuse(*args, **kwargs):
        raise batch.Fallback

    monkeypatch.setattr(flush, "index_flush", refuse)


def decode(path, owned=None):
    return list(iter_delta(open_delta(path), current_version=0, owned=owned, lazy=True))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: compares bit patterns (-0 and NaNs included)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b) -> None:
    assert (a.name, a.shape, a.dtype, a.needs_base, a.skipped, a.bounds, a.blocks) == (
        b.name,
        b.shape,
        b.dtype,
        b.needs_base,
        b.skipped,
        b.bounds,
        b.blocks,
    )
    assert a.positions.dtype == b.positions.dtype == torch.int64 and torch.equal(a.positions, b.positions)
    assert a.values.dtype == b.values.dtype
    assert torch.equal(bits(a.values), bits(b.values))


@pytest.mark.parametrize("encoding", ["ulp_zstd", "planes_zstd", "deltas_zstd"])
@pytest.mark.parametrize("density", [0.02, 0.3])
@pytest.mark.parametrize("owned_kind", ["all", "ranges"])
def test_batched_equals_per_param_path_and_the_new_weights(
    tmp_path, monkeypatch, encoding, density, owned_kind
):
    old = model(12)
    new = step(old, density, seed=1)
    path = write(tmp_path / "d", old, new, encoding)
    owned = None
    if owned_kind == "ranges":  # one range, several ranges, none, and a param left whole
        owned = {"big": [(100, 900), (2000, 2100), (3000, 4095)], "e0": [], "e1": [(0, 40)], "norm": None}
        owned.update({f"e{i}": [(64 * i, 511)] for i in range(2, 12)})
    with monkeypatch.context() as m:  # the batched path, and it alone
        m.setattr(flush, "plan_blocked", lambda *a, **k: pytest.fail("fell back to the per-param path"))
        fast = decode(path, owned)
    per_param_path(monkeypatch)
    slow = decode(path, owned)
    assert len(fast) == len(slow) == len(new)
    for a, b in zip(fast, slow):
        same(a, b)
        o, n = old[a.name].reshape(-1), new[a.name].reshape(-1)
        got = a.resolve(o[a.positions]) if a.needs_base else a.values
        assert torch.equal(bits(got), bits(n[a.positions]))  # the writer's own input
    if owned_kind == "ranges":
        assert {d.name: d.count for d in fast}["e0"] == 0 and any(d.skipped for d in fast)


def test_batches_and_a_param_past_a_batch(tmp_path, monkeypatch):
    # Batches of at most 40 entries: several batches, and params past one go to the per-param path.
    old = model(12)
    new = step(old, 0.1, seed=4)
    path = write(tmp_path / "d", old, new, "ulp_zstd")
    slow_params, plans = [], []
    real_decode, real_plan = flush._decode_blocked, flush.plan_blocked
    with monkeypatch.context() as m:
        m.setattr(batch, "BATCH_ENTRIES", 40)
        m.setattr(
            flush,
            "_decode_blocked",
            lambda enc, s, d, p, **k: (
                slow_params.extend(x[0].name for x in p) or real_decode(enc, s, d, p, **k)
            ),
        )
        m.setattr(flush, "plan_blocked", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
        fast = decode(path)
    per_param_path(monkeypatch)
    slow = decode(path)
    for a, b in zip(fast, slow, strict=True):
        same(a, b)
    past = sorted(d.name for d in slow if d.count > 40)
    assert past and sorted(slow_params) == past and len(plans) == 1  # planned once, for those alone


def test_a_large_param_decodes_on_the_per_param_path_and_the_rest_in_batches(tmp_path, monkeypatch):
    # The per-param path decodes a large param's changes several times cheaper than a batch's gathers.
    old = model(12)
    new = step(old, 0.1, seed=4)
    path = write(tmp_path / "d", old, new, "deltas_zstd")
    slow_params = []
    real_decode = flush._decode_blocked
    with monkeypatch.context() as m:
        m.setattr(batch, "PER_PARAM_ENTRIES", 30)
        m.setattr(
            flush,
            "_decode_blocked",
            lambda enc, s, d, p, **k: (
                slow_params.extend(x[0].name for x in p) or real_decode(enc, s, d, p, **k)
            ),
        )
        fast = decode(path)
    per_param_path(monkeypatch)
    slow = decode(path)
    for a, b in zip(fast, slow, strict=True):
        same(a, b)
    large = sorted(d.name for d in slow if d.count >= 30)
    assert large and len(large) < len(slow) and sorted(slow_params) == large


class _Counting:
    """A zstd decompressor that counts what is asked of it. A wrapper, not a subclass: freeing an
    instance of a Python subclass of python-zstandard's C type corrupts the heap."""

    made = 0
    frames = 0  # one-frame decompress calls
    batches = 0  # multi-frame calls

    def __init__(self, *args, **kwargs):
        self._real = _REAL_DECOMPRESSOR(*args, **kwargs)
        type(self).made += 1

    def decompress(self, *args, **kwargs):
        type(self).frames += 1
        return self._real.decompress(*args, **kwargs)

    def multi_decompress_to_buffer(self, *args, **kwargs):
        type(self).batches += 1
        return self._real.multi_decompress_to_buffer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


_REAL_DECOMPRESSOR = zstandard.ZstdDecompressor


def zstd_counts(monkeypatch, path) -> tuple[int, int, int, int]:
    """(contexts made, one-frame calls, multi-frame calls, per-param index parses) for reading `path`."""

    class Counting(_Counting):
        pass

    parses = []
    real_parse_index = flush.parse_index
    with monkeypatch.context() as m:
        m.setattr(zstandard, "ZstdDecompressor", Counting)
        m.setattr(container, "_local", threading.local())  # this thread's context is made afresh
        m.setattr(flush, "parse_index", lambda *a, **k: parses.append(1) or real_parse_index(*a, **k))
        assert sum(d.count for d in decode(path)) > 0
    return Counting.made, Counting.frames, Counting.batches, len(parses)


def test_zstd_contexts_and_calls_are_per_flush_not_per_param(tmp_path, monkeypatch):
    counts = {}
    for n in (8, 96):
        old = model(n)
        path = write(tmp_path / f"d{n}", old, step(old, 0.05, seed=2), "ulp_zstd", policy=Policy())
        assert len(open_delta(path).manifest.files) == 1
        counts[n] = zstd_counts(monkeypatch, path)
    streams = len(
        json.loads(
            unpack((path / open_delta(path).manifest.files[0].name).read_bytes(), file=None, limits=Limits())[
                1
            ]["streams"]
        )
    )
    made, frames, batches, parses = counts[96]
    assert counts[8] == counts[96]  # 12x the params, the same counts
    assert (made, frames, parses) == (1, 0, 0)  # one context, no frame on its own, no per-param index parse
    assert 0 < batches <= streams  # one call per stream (whole-file hash, header and this flush's batch)


def _retouched(path, param: str, stream: str, make_frame, decoded: int | None = None) -> None:
    """Replace param's first block frame of `stream` by `make_frame(decoded size the index gives)`,
    fix the index's stored length (and give it `decoded` as the decoded length, with the stream's and
    the file's declared sizes to match) and re-sign the manifest, as a sender who controls both could."""
    name = open_delta(path).manifest.files[0].name
    tensors, meta = unpack((path / name).read_bytes(), file=name, limits=Limits())
    blobs = {k: bytes(t.data) for k, t in tensors.items()}
    params = json.loads(meta["params"])
    at = 0
    for p in params:
        if stream not in p["streams"]:
            continue
        j = p["streams"].index(stream)
        if p["name"] == param:
            lengths = p["blocks"][0][3]
            frame = make_frame(lengths[2 * j + 1])
            blob = blobs[f"__{stream}__"]
            blobs[f"__{stream}__"] = blob[:at] + frame + blob[at + lengths[2 * j] :]
            lengths[2 * j] = len(frame)
            grow = 0 if decoded is None else decoded - lengths[2 * j + 1]
            lengths[2 * j + 1] += grow
            break
        at += sum(r[3][2 * j] for r in p["blocks"])
    streams = json.loads(meta["streams"])
    streams[stream]["size"] += grow
    data = pack(
        blobs, dict(meta, params=json.dumps(params, separators=(",", ":")), streams=json.dumps(streams))
    )
    (path / name).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(
        bytes=len(data), hash=bytes_digest(data), decoded_bytes=m["files"][0]["decoded_bytes"] + grow
    )
    (path / "manifest.json").write_text(json.dumps(m))


_Z = zstandard.ZstdCompressor(level=1)
DAMAGE = {  # n: the decoded size the index gives the frame
    "trailing bytes": lambda n: _Z.compress(b"\0" * n) + b"\0\0\0",
    "header says a size over the index's": lambda n: _Z.compress(b"\0" * (n + 5)),
    "header says a size under the index's": lambda n: _Z.compress(b"\0" * (n - 1)),
    "skippable frame": lambda n: b"\x50\x2a\x4d\x18" + n.to_bytes(4, "little") + b"\0" * n,
    "truncated frame": lambda n: _Z.compress(b"\0" * n)[:-1],
    "two frames": lambda n: _Z.compress(b"\0" * (n - 1)) + _Z.compress(b"\0"),
}


@pytest.mark.parametrize("batch_entries", [batch.BATCH_ENTRIES, 100])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_hostile_frames_fail_alike_on_both_paths(tmp_path, monkeypatch, damage, batch_entries):
    monkeypatch.setattr(batch, "BATCH_ENTRIES", batch_entries)  # small: e3 sits in a later batch
    old = model(6)
    path = write(tmp_path / "d", old, step(old, 0.3, seed=3), "ulp_zstd")
    _retouched(path, "e3", "sign", DAMAGE[damage])
    errors = []
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                per_param_path(m)
            seen = []
            with pytest.raises(CorruptDeltaError) as e:
                for d in iter_delta(open_delta(path), current_version=0, lazy=True):
                    seen.append(d.name)
            errors.append((type(e.value), e.value.param, "e3" in seen, "e2" in seen))
    assert errors[0] == errors[1]
    assert errors[0][1:] == ("e3", False, True)  # raised at e3, before it is returned


def test_escapes_where_a_param_has_none_fail_alike(tmp_path, monkeypatch):
    # Steps of one ULP only, so no param has escapes; an esc0 frame of one byte is not e3's data.
    old = model(6)
    new = {}
    for name, t in old.items():
        bits = t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()
        bits[::3] += 1
        new[name] = bits.view(t.dtype).reshape(t.shape)
    path = write(tmp_path / "d", old, new, "ulp_zstd")
    _retouched(path, "e3", "esc0", lambda n: _Z.compress(b"\7"), decoded=1)
    errors = []
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                per_param_path(m)
            with pytest.raises(CorruptDeltaError) as e:
                decode(path)
            errors.append((type(e.value), e.value.param))
    assert errors[0] == errors[1] and errors[0][1] == "e3"


def test_frames_of_every_block_kind_pass_and_trailing_bytes_do_not():
    # Raw, RLE and compressed blocks, several blocks a frame, checksums: read by the frame walker.
    rng = np.random.default_rng(0)
    payloads = [
        rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes(),
        b"\0" * 200_000,
        bytes(range(256)) * 900,
        b"x",
    ]
    frames = [
        zstandard.ZstdCompressor(level=1, write_checksum=k % 2 == 1).compress(p)
        for k, p in enumerate(payloads)
    ]
    stream = b"".join(frames)
    offset = np.cumsum([0] + [len(f) for f in frames[:-1]])
    stored = np.array([len(f) for f in frames])
    decoded = np.array([len(p) for p in payloads])
    assert batch_host.frames(memoryview(stream), offset, stored, decoded) == b"".join(payloads)
    padded = b"".join(f + b"\0" for f in frames)
    with pytest.raises(batch.Fallback):
        batch_host.frames(memoryview(padded), offset + np.arange(len(frames)), stored + 1, decoded)
    with pytest.raises(batch.Fallback):  # the index says one byte more than the header
        batch_host.frames(memoryview(stream), offset, stored, decoded + 1)
