"""HF checkpoint directories (sharded with `model.safetensors.index.json`, or single files), read by the
offline tools (`vllm-delta diff`, `apply`), seeding and the engine's placement."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .dtypes import by_st_code

INDEX_NAME = "model.safetensors.index.json"


class Checkpoint:
    """An HF checkpoint directory. Each shard is opened, and its header parsed, at most once and only
    when one of its tensors is first needed. Why: the offline tools and seeding touch every tensor (37k
    in a 94-layer, 128-expert MoE), a trainer rank only its own tensors' shards."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / INDEX_NAME
        where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        files = sorted({*where.values()} if where else (p.name for p in self.path.glob("*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path}: no safetensors checkpoint found")
        self._handles: dict[str, object] = {}  # shard file -> open safe_open handle
        self._meta: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}  # shard -> its header
        self.shards: dict[str, list[str]] = {}  # shard file -> tensor names
        if where is None:  # no index: the headers say what each file holds
            self.shards = {f: list(self._header(f)) for f in files}
            where = {k: f for f, names in self.shards.items() for k in names}
        else:
            self.shards = {f: [] for f in files}
            for k, f in where.items():
                self.shards[f].append(k)
        self._where = where  # tensor -> shard file

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        return cls(path)

    def _handle(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = safe_open(self.path / shard, framework="pt")
        return h

    def _header(self, shard: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """`shard`'s tensors -> (shape, dtype), parsed once; refused if the index names others."""
        meta = self._meta.get(shard)
        if meta is None:
            h = self._handle(shard)
            meta = {}
            for k in h.keys():
                s = h.get_slice(k)
                meta[k] = (tuple(s.get_shape()), by_st_code(s.get_dtype(), file=shard).torch)
            listed = self.shards.get(shard)
            if listed is not None and sorted(listed) != sorted(meta):
                raise ValueError(
                    f"{self.path / shard}: holds other tensors than {INDEX_NAME} says "
                    f"({sorted(set(meta) ^ set(listed))[:5]})"
                )
            self._meta[shard] = meta
        return meta

    @cached_property
    def meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor -> (shape, dtype) (reads every shard's header, once)."""
        return {k: v for f in self.shards for k, v in self._header(f).items()}

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """`name`'s (shape, dtype), from its own shard's header only."""
        return self._header(self._shard_of(name))[name]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _shard_of(self, name: str) -> str:
        f = self._where.get(name)
        if f is None:
            raise KeyError(f"{name}: not in the checkpoint {self.path}")
        return f

    @property
    def elements(self) -> int:
        return sum(torch.Size(shape).numel() for shape, _ in self.meta.values())

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one shard in memory at a time."""
        for f in self.shards:
            yield from load_file(self.path / f).items()

    def read(self, name: str) -> torch.Tensor:
        shard = self._shard_of(name)
        self._header(shard)  # checks the index against the shard, once
        return self._handle(shard).get_tensor(name)

    def read_at(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """`read(name).reshape(-1)[flat]`, reading only the rows (and a matrix's columns) `flat` spans."""
        shape, dtype = self.info(name)
        if flat.numel() == 0:
            return torch.empty(0, dtype=dtype)
        if not shape:
            return self.read(name).reshape(-1)[flat]
        row = math.prod(shape[1:])
        part = self._handle(self._shard_of(name)).get_slice(name)
        r0, r1 = int(flat.min()) // row, int(flat.max()) // row + 1
        if len(shape) != 2:
            return part[r0:r1].reshape(-1)[flat - r0 * row]
        col = flat % row
        c0, c1 = int(col.min()), int(col.max()) + 1
        return part[r0:r1, c0:c1].reshape(-1)[(flat // row - r0) * (c1 - c0) + col - c0]

    def read_runs(self, name: str, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The flat runs `(start, length)` of `read(name).reshape(-1)`, concatenated: the block `read_at`
        would read, with no per-element index (a rank's shard can be billions)."""
        shape, dtype = self.info(name)
        if not runs:
            return torch.empty(0, dtype=dtype)
        if not shape:
            return self.read(name).reshape(-1)
        row = math.prod(shape[1:])
        part = self._handle(self._shard_of(name)).get_slice(name)
        r0 = min(a for a, _ in runs) // row
        r1 = max(a + n - 1 for a, n in runs) // row + 1
        if len(shape) == 2 and all(a // row == (a + n - 1) // row for a, n in runs):
            c0, c1 = min(a % row for a, _ in runs), max(a % row + n for a, n in runs)
            flat, width = part[r0:r1, c0:c1].reshape(-1), c1 - c0
        else:
            flat, width, c0 = part[r0:r1].reshape(-1), row, 0
        at = [((a // row - r0) * width + a % row - c0, n) for a, n in runs]
        return (
            flat[at[0][0] : at[0][0] + at[0][1]]
            if len(at) == 1
            else torch.cat([flat[o : o + n] for o, n in at])
        )

    def shard_metadata(self, shard: str) -> dict[str, str] | None:
        return self._handle(shard).metadata()

    def copy_other_files(self, dest: Path) -> None:
        """Everything but the tensor shards: config, tokenizer, the index."""
        for p in self.path.iterdir():
            if p.name in self.shards:
                continue
            if p.is_dir():
                shutil.copytree(p, dest / p.name)
            else:
                shutil.copy2(p, dest / p.name)


@contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling renamed to `out` on success and removed on failure: all or nothing."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
