"""A flush's frames of one stored (raw) or RLE block are copied out without zstd, and give what zstd gives.

Why: a tensor of a few changes has five frames of a few bytes (one per stream of its one block),
220k of them at GLM-4.7's 44k tensors; each cost a zstd call and a Python object in the batch read
(docs/results/scale.md, "Prepare per-tensor cost (session 9)"). So the frames handed to zstd are
COUNTED (never timed): none for a flush of such tensors. Every frame is held to zstd's own output
(its one-shot decompress, the reference here), and what zstd refuses still falls back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from vllm_delta.wire import DeltaWriter, batch, batch_host, container, read_delta
from vllm_delta.wire.deltas import DeltaBatch

MAGIC = b"\x28\xb5\x2f\xfd"


def _frame(
    content: bytes,
    *,
    kind: int = 0,
    fcs: int | None = None,
    single: int = 1,
    dict_id: int = 0,
    last: int = 1,
    block: int | None = None,
    window: int = 0,
    declared: int | None = None,
) -> bytes:
    """A zstd frame of one block of `content` (kind 0: stored, 1: RLE of its first byte, 2: `content` as a
    compressed block), by RFC 8878; `fcs`: the content size's field (by default the smallest that holds
    it); `block` and `declared`: a block size and a content size other than the content's."""
    n = len(content) if declared is None else declared
    if fcs is None:
        fcs = 0 if single and n < 256 else 1 if 256 <= n < 65536 + 256 else 2
    head = MAGIC + bytes([fcs << 6 | single << 5 | dict_id])
    if not single:
        head += bytes([window])  # window descriptor (0: 1 KiB)
    head += b"\x07" * (0, 1, 2, 4)[dict_id]
    size = n - 256 if fcs == 1 else n
    head += size.to_bytes((1 if single else 0, 2, 4, 8)[fcs], "little") if fcs or single else b""
    length = len(content) if block is None else block
    body = content[:1] if kind == 1 else content
    return head + (last | kind << 1 | length << 3).to_bytes(3, "little") + body


def _bad_checksum(content: bytes) -> bytes:
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(content)
    assert frame[4] >> 2 & 1 and (frame[-4 - len(content) - 3] >> 1) & 3 == 0  # a checksum; one stored block
    return frame[:-1] + bytes([frame[-1] ^ 1])


def _read(frames: list[bytes], decoded: list[int]) -> bytes:
    stream = b"".join(frames)
    offset = np.cumsum([0] + [len(f) for f in frames[:-1]])
    return batch_host.frames(
        memoryview(stream), offset, np.array([len(f) for f in frames]), np.array(decoded)
    )


def _zstd(frame: bytes, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)


def test_stored_and_rle_frames_give_what_zstd_gives():
    rng = np.random.default_rng(0)
    contents = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 2, 3, 17, 255, 300, 1 << 17)]
    frames = (
        [_frame(c) for c in contents]
        + [_frame(c[:1] * len(c), kind=1) for c in contents]
        + [
            _frame(contents[5], fcs=1),
            _frame(contents[5], fcs=2),
            _frame(contents[3], fcs=3),
            _frame(contents[3], single=0, fcs=2),  # a window descriptor: left to zstd
            _frame(b"\5" * ((1 << 17) + 1)),
        ]  # a block past the spec's largest: left to zstd, which takes it
        + [
            zstandard.ZstdCompressor(level=1, write_checksum=c).compress(p)
            for c in (False, True)
            for p in (b"x", b"ab" * 500, contents[4])
        ]
    )  # zstd's own frames
    want = [_zstd(f, 1 << 18) for f in frames]  # the reference: zstd's one-shot decompress of each
    assert _read(frames, [len(w) for w in want]) == b"".join(want)
    for f, w in zip(frames, want):  # alone too, and each next to a compressed one
        other = zstandard.ZstdCompressor(level=3).compress(b"zz" * 100)
        assert _read([f], [len(w)]) == w and _read([other, f], [200, len(w)]) == b"zz" * 100 + w


@pytest.mark.parametrize(
    "frame, size",
    [
        (_frame(b"abc", block=2), 3),
        (_frame(b"abc", block=4), 3),  # a block size other than its extent
        (_frame(b"ab", declared=3), 3),
        (_frame(b"ab", kind=1, declared=3), 3),  # ... than the frame's content size
        (_frame(b"abc", kind=2), 3),  # a compressed block as long as its content: not a stored one
        (_frame(b"abc", dict_id=1), 3),  # a dictionary this reader does not have
        (_frame(b"abc", last=0), 3),  # no last block
        (_frame(b"a" * 300, single=0, fcs=1, window=0xF8), 300),  # a window of 2^41 B
        (_bad_checksum(b"abc"), 3),  # a stored block whose checksum is wrong
    ],
    ids=[
        "short block",
        "long block",
        "short content",
        "short rle",
        "compressed",
        "dictionary",
        "not last",
        "huge window",
        "checksum",
    ],
)
def test_what_zstd_refuses_still_falls_back(frame, size):
    with pytest.raises(zstandard.ZstdError):
        _zstd(frame, 1 << 18)
    with pytest.raises(batch.Fallback):
        _read([frame], [size])


class _Frames:
    """Counts the frames handed to zstd's batch call (wraps the thread's context)."""

    def __init__(self, real) -> None:
        self.real, self.frames = real, 0

    def multi_decompress_to_buffer(self, buffers, **kwargs):
        self.frames += len(buffers)
        return self.real.multi_decompress_to_buffer(buffers, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _delta(path, tensors: int, changes: int):
    g = torch.Generator().manual_seed(0)
    with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd") as w:
        for i in range(tensors):
            old = torch.randn(changes, generator=g).to(torch.bfloat16)
            steps = torch.randint(1, 300, (changes,), generator=g).to(torch.int16)
            w.add(
                f"t{i}",
                torch.arange(changes) * 3,
                (old.view(torch.int16) + steps).view(torch.bfloat16),
                old,
                shape=(4 * changes,),
            )
    return path


@pytest.mark.parametrize("changes, zstd_frames", [(2, 0), (3000, None)])
def test_tiny_tensors_hand_no_frame_to_zstd(tmp_path, monkeypatch, changes, zstd_frames):
    """A flush of tensors of a few changes each: no frame goes to zstd, and the batch read gives the
    per-param path's changes; larger tensors' frames (compressed blocks) still do."""
    path = _delta(tmp_path / "d", 12, changes)
    ctx = _Frames(container.decompressor())
    monkeypatch.setattr(batch_host, "decompressor", lambda: ctx)
    items = read_delta(path, current_version=0, batches=True)
    monkeypatch.undo()
    assert {type(i) for i in items} == {DeltaBatch}  # the batch path read them all
    got = [d for item in items for d in item.deltas()]
    assert ctx.frames == zstd_frames if zstd_frames is not None else ctx.frames > 0
    with monkeypatch.context() as m:
        m.setattr(batch, "_supported", lambda enc: False)  # the per-param path, the reference
        want = read_delta(path, current_version=0)
    assert [d.name for d in got] == [d.name for d in want]
    for a, b in zip(got, want):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
