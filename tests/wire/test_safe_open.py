"""Delta files are opened from a directory handle, never through a symlink, only as regular files of
the size the manifest states (`vllm_delta.wire.container.DeltaDir`).

Why: the engine's API server checks a path, and its workers open the files later. Real symlinks,
FIFOs and directories stand in for what an attacker with write access under the root could plant.
Each call that could block runs in a thread with a deadline, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from wire_helpers import model_tensors, perturb, seed_flush_bytes, write_delta

from vllm_delta.wire import FormatError, IncompleteDeltaError, IntegrityError, flush_name, read_delta
from vllm_delta.wire.container import DeltaDir

F = flush_name(0, 0)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`, or a test failure if it has not returned after `seconds` (a FIFO read blocks forever)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still blocked after {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def root(tmp_path) -> Path:
    old = model_tensors(1)
    write_delta(tmp_path / "runs" / "v1", old, perturb(old, 2), base_version=None, encoding="planes_zstd")
    return tmp_path


def read(root: Path, rel: str = "runs/v1") -> list:
    with DeltaDir.open(root / rel, root=root) as d:
        return within(10, lambda: read_delta(d))


def test_a_plain_delta_reads_from_the_root_handle(root):
    by_abs = read(root)
    with DeltaDir.open("runs/v1", root=root) as d:  # relative to the root works the same
        by_rel = read_delta(d)
    assert by_abs and [p.name for p in by_abs] == [p.name for p in by_rel]
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(by_abs, by_rel))


def test_symlinked_directory_on_the_way_is_refused(root):
    (root / "link").symlink_to(root / "runs")
    with pytest.raises(FormatError, match="symlink"):
        read(root, "link/v1")


def test_path_leaving_the_root_is_refused(root, tmp_path_factory):
    with pytest.raises(FormatError, match="plain path"):
        DeltaDir.open("runs/../runs/v1", root=root)
    with pytest.raises(FormatError, match="plain path"):
        DeltaDir.open(tmp_path_factory.mktemp("elsewhere"), root=root)


def test_symlinked_flush_file_is_refused(root):
    d = root / "runs" / "v1"
    (d / F).rename(root / "moved.safetensors")
    (d / F).symlink_to(root / "moved.safetensors")
    with pytest.raises(FormatError, match="symlink") as exc:
        read(root)
    assert exc.value.file == F


@pytest.mark.parametrize("name", ["manifest.json", F])
def test_fifo_is_refused_without_blocking(root, name):
    d = root / "runs" / "v1"
    (d / name).unlink()
    os.mkfifo(d / name)
    with pytest.raises(FormatError, match="regular file") as exc:
        read(root)
    assert exc.value.file == name


def test_directory_or_socket_in_place_of_a_flush_file_is_refused(root, monkeypatch):
    d = root / "runs" / "v1"
    (d / F).unlink()
    (d / F).mkdir()
    with pytest.raises(FormatError, match="regular file"):
        read(root)
    (d / F).rmdir()
    monkeypatch.chdir(d)  # a relative name: socket paths are limited to 108 bytes
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(F)
        with pytest.raises(FormatError, match="regular file"):
            read(root)


def test_size_is_checked_against_the_manifest_before_reading(root):
    d = root / "runs" / "v1"
    with open(d / F, "ab") as f:
        f.write(b"\0" * 100)
    with pytest.raises(IntegrityError, match="manifest says") as exc:
        read(root)
    assert exc.value.file == F


def test_missing_directory_and_file(root):
    with pytest.raises(IncompleteDeltaError):
        DeltaDir.open("runs/v2", root=root)
    (root / "runs" / "v1" / F).unlink()
    with pytest.raises(IncompleteDeltaError) as exc:
        read(root)
    assert exc.value.file == F


def test_seed_delta_fifo_is_refused_without_blocking(tmp_path):
    """A manifest-less seed delta has no sizes to check first: a FIFO must still not block."""
    old = torch.zeros(16, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = 1.0
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(seed_flush_bytes([("w", old, new)]))
    os.mkfifo(tmp_path / "rank0000_flush000001.safetensors")
    with pytest.raises(FormatError, match="regular file") as exc:
        within(10, lambda: read_delta(tmp_path, allow_seed=True))
    assert exc.value.file == "rank0000_flush000001.safetensors"
