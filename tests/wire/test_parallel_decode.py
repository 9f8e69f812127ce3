"""Flushes decoded on several threads (`iter_delta(threads=)`): the same changes, in the same order,
with the same errors, and at most threads + 1 decoded flushes held at once (issue 16: "multi-threaded
across flushes, with bounded memory").

Concurrency is shown by a barrier that two decodes must reach together (it times out otherwise),
not by a time.
"""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_delta.wire import DeltaWriter, iter_delta, load_manifest
from vllm_delta.wire.errors import IntegrityError
from vllm_delta.wire.reader import DeltaDecoder

SHAPE = (64, 64)


def _write(path, params: int = 8) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A delta of `params` tensors in small flushes (several params and flushes each): what was written."""
    gen = torch.Generator().manual_seed(0)
    written = {}
    with DeltaWriter(path, version=1, base_version=0, encoding="deltas_zstd", flush_bytes=4096) as w:
        for i in range(params):
            pos = torch.randperm(SHAPE[0] * SHAPE[1], generator=gen)[:700].sort().values
            values = torch.randn(700, generator=gen).to(torch.bfloat16)
            w.add(f"p{i}", pos, values, shape=SHAPE)
            written[f"p{i}"] = (pos, values)
    assert len(load_manifest(path).files) >= 6
    return written


def _flat(deltas) -> list[tuple[str, list[int], list[int]]]:
    return [(d.name, d.positions.tolist(), d.values.view(torch.int16).tolist()) for d in deltas]


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_give_the_same_changes_in_the_same_order(tmp_path, threads):
    written = _write(tmp_path)
    one = _flat(iter_delta(tmp_path, lazy=True))
    assert _flat(iter_delta(tmp_path, lazy=True, threads=threads)) == one
    got: dict[str, list] = {}
    for name, pos, _ in one:
        got.setdefault(name, []).extend(pos)
    assert {n: p.tolist() for n, (p, _) in written.items()} == got  # the writer's input, not the other path


def test_flushes_are_decoded_at_once_and_no_more_than_threads_ahead(tmp_path, monkeypatch):
    _write(tmp_path)
    together = threading.Barrier(2, timeout=10)
    held, most, lock = [0], [0], threading.Lock()
    calls, met = [], []
    decode, admit = DeltaDecoder.decode, DeltaDecoder.admit

    def decoding(self, name, data, **kw):
        with lock:
            calls.append(name)
            first_two = len(calls) <= 2
        if first_two:  # the first two decodes must be running at the same time, or this times out
            try:
                together.wait()
                met.append(name)
            except threading.BrokenBarrierError:
                pass
        out = decode(self, name, data, **kw)
        with lock:
            held[0] += 1
            most[0] = max(most[0], held[0])
        return out

    def admitting(self, name, deltas):
        yield from admit(self, name, deltas)
        with lock:
            held[0] -= 1

    monkeypatch.setattr(DeltaDecoder, "decode", decoding)
    monkeypatch.setattr(DeltaDecoder, "admit", admitting)
    list(iter_delta(tmp_path, threads=2))
    assert len(met) == 2  # two flushes were being decoded at once
    assert 1 <= most[0] <= 3  # threads + the one being consumed


def test_an_error_in_a_later_flush_surfaces_in_manifest_order(tmp_path):
    _write(tmp_path)
    files = [f.name for f in load_manifest(tmp_path).files]
    bad = tmp_path / files[2]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x55
    bad.write_bytes(bytes(data))
    for threads in (1, 3):
        seen = []
        with pytest.raises(IntegrityError) as err:
            for d in iter_delta(tmp_path, threads=threads):
                seen.append(d.name)
        assert err.value.file == files[2]
        assert seen == [d.name for d in iter_delta(tmp_path, files=files[:2])]
