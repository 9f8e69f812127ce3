"""Checkpoint reading scales with the bytes read, not with the tensor count (issue 18, item 8).

Why: `Checkpoint.read` found a tensor's shard by a linear search and reopened and re-parsed that
shard's header for every tensor, so `vllm-delta diff` on a 37k-tensor MoE checkpoint ran for more
than 12 minutes, and `seed_from_checkpoint(like=)` read the whole checkpoint on every rank. The
opens are counted by the kernel (inotify on the checkpoint directory), not by the code under test.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_delta import DeltaSender
from vllm_delta.cli import main
from vllm_delta.sender.shards import Segments, Shard
from vllm_delta.wire.checkpoint import INDEX_NAME, Checkpoint

SHARDS, PER_SHARD = 4, 30
IN_CLOSE_NOWRITE, IN_OPEN = 0x10, 0x20


@contextmanager
def file_opens(directory: Path) -> Iterator[collections.Counter]:
    """How often each shard in `directory` is opened inside the block. Close events are watched too:
    inotify merges identical back-to-back events, and a close between two opens keeps them apart."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    if fd < 0 or libc.inotify_add_watch(fd, str(directory).encode(), IN_OPEN | IN_CLOSE_NOWRITE) < 0:
        pytest.skip(f"inotify unavailable (errno {ctypes.get_errno()})")
    counts: collections.Counter = collections.Counter()
    try:
        yield counts
        while True:
            try:
                buf = os.read(fd, 1 << 20)
            except BlockingIOError:
                break
            i = 0
            while i < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16 : i + 16 + n].rstrip(b"\0").decode()
                if mask & IN_OPEN and name.endswith(".safetensors"):
                    counts[name] += 1
                i += 16 + n
    finally:
        os.close(fd)


def write_sharded(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    names, weight_map = list(tensors), {}
    for i in range(SHARDS):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        keys = names[i * PER_SHARD : (i + 1) * PER_SHARD]
        save_file({k: tensors[k] for k in keys}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    old = {
        f"model.layers.{i}.mlp.experts.{e}.up_proj.weight": torch.randn(8, 6, generator=g).bfloat16()
        for i in range(SHARDS * PER_SHARD // 10)
        for e in range(10)
    }
    new = {}
    for n, t in old.items():
        bits = t.view(torch.int16).clone()
        bits.view(-1)[::7] += 1
        new[n] = bits.view(torch.bfloat16)
    return write_sharded(tmp_path / "old", old), write_sharded(tmp_path / "new", new)


def test_diff_apply_verify_open_each_shard_a_bounded_number_of_times(pair, tmp_path, capsys):
    old, new = pair
    with file_opens(old) as o, file_opens(new) as n:
        assert main(["diff", str(old), str(new), str(tmp_path / "delta")]) == 0
    # A header parse and a load per shard at most, whatever the tensor count (it was once per tensor).
    assert set(o) | set(n) >= {f for f in os.listdir(old) if f.endswith(".safetensors")}
    assert max(o.values()) <= 2 and max(n.values()) <= 2, (o, n)
    with file_opens(old) as o:
        assert main(["apply", str(old), str(tmp_path / "delta"), str(tmp_path / "applied")]) == 0
        assert main(["verify", str(tmp_path / "delta"), "--base", str(old)]) == 0
    assert max(o.values()) <= 2 * 2, o  # two tools, each at most twice per shard
    got, want = Checkpoint.open(tmp_path / "applied"), Checkpoint.open(new)
    for name in want.meta:  # the applied checkpoint is NEW, bit for bit
        assert torch.equal(got.read(name).view(torch.int16), want.read(name).view(torch.int16)), name


def test_a_read_opens_only_its_own_shard_once(pair):
    old, _ = pair
    ckpt = Checkpoint.open(old)
    third = f"model-00003-of-{SHARDS:05d}.safetensors"
    names = ckpt.shards[third]
    with file_opens(old) as o:
        for name in names:
            ckpt.read(name)
            ckpt.info(name)
    assert dict(o) == {third: 1}, o
    assert ckpt.meta is ckpt.meta  # built once: cmd_diff reads it per tensor


def test_seed_from_checkpoint_like_opens_only_this_ranks_shards(pair, tmp_path):
    old, _ = pair
    ckpt = Checkpoint.open(old)
    second = f"model-00002-of-{SHARDS:05d}.safetensors"
    a, b = ckpt.shards[second][:2]
    full_a, full_b = load_file(old / second)[a], load_file(old / second)[b]
    like = [
        Shard.narrow(a, torch.zeros(4, 6, dtype=torch.bfloat16), full_a.shape, 0, 4),  # rows 4..7
        Segments(
            b,
            torch.zeros(8, 3, dtype=torch.bfloat16),
            tuple(full_b.shape),
            tuple((r * 6 + 3, 3) for r in range(8)),
        ),
    ]  # columns 3..5 of every row
    sender = DeltaSender(["http://127.0.0.1:9"], "disk", tmp_path / "d")
    with file_opens(old) as o:
        sender.seed_from_checkpoint(old, like=like)
    assert dict(o) == {second: 1}, o
    for name, want in ((a, full_a[4:]), (b, full_b[:, 3:])):
        got = sender.producer.snapshot_of(name)
        assert torch.equal(got.view(torch.int16), want.reshape(-1).view(torch.int16)), name
    sender.close()


@pytest.mark.parametrize(
    "shape, pick",
    [
        ((10, 6), lambda: torch.arange(18, 42)),  # rows 3..6: a dim-0 TP shard
        ((10, 6), lambda: torch.arange(60).view(10, 6)[:, 2:4].reshape(-1)),  # a dim-1 TP shard
        ((10, 6), lambda: torch.tensor([59, 0, 31, 7])),  # scattered, unordered
        ((12,), lambda: torch.arange(5, 9)),
        ((3, 4, 5), lambda: torch.arange(20, 45)),
        ((), lambda: torch.tensor([0])),
    ],
)
def test_read_at_is_the_flat_index_of_the_whole_tensor(tmp_path, shape, pick):
    full = torch.randn(shape).bfloat16()
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    flat = pick()
    got = Checkpoint.open(tmp_path).read_at("w", flat)
    want = load_file(tmp_path / "model.safetensors")["w"].reshape(-1)[flat]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_an_index_that_misnames_a_shards_tensors_is_refused(pair):
    old, _ = pair
    index = json.loads((old / INDEX_NAME).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = f"model-00002-of-{SHARDS:05d}.safetensors"  # it lives in shard 1
    (old / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="other tensors than"):
        Checkpoint.open(old).read(name)


@pytest.mark.parametrize(
    "shape, runs",
    [
        ((10, 6), [(18, 24)]),  # rows 3..6: a dim-0 TP shard
        ((10, 6), [(r * 6 + 2, 2) for r in range(10)]),  # columns 2..3 of every row: a dim-1 TP shard
        ((10, 6), [(40, 8), (4, 9)]),  # out of order, crossing rows
        ((12,), [(5, 4), (0, 2)]),
        ((3, 4, 5), [(20, 25)]),
        ((), [(0, 1)]),
    ],
)
def test_read_runs_is_the_runs_of_the_whole_tensor(tmp_path, shape, runs):
    full = torch.randn(shape).bfloat16()
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    got = Checkpoint.open(tmp_path).read_runs("w", runs)
    flat = load_file(tmp_path / "model.safetensors")["w"].reshape(-1)
    want = torch.cat([flat[a : a + n] for a, n in runs])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
