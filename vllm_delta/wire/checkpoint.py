"""HF checkpoint directories (sharded with `model.safetensors.index.json`, or single files).

Used by the offline tools: `vllm-delta diff` reads two of them, `apply` writes one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .dtypes import by_st_code

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    shards: dict[str, list[str]]  # shard file -> tensor names, in file order
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]  # tensor -> (shape, dtype)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        path = Path(path)
        index = path / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no safetensors checkpoint found")
        shards, meta = {}, {}
        for f in files:
            with safe_open(path / f, framework="pt") as h:
                shards[f] = list(h.keys())
                for k in shards[f]:
                    s = h.get_slice(k)
                    meta[k] = (tuple(s.get_shape()), by_st_code(s.get_dtype()).torch)
        return cls(path, shards, meta)

    @property
    def elements(self) -> int:
        return sum(torch.Size(shape).numel() for shape, _ in self.meta.values())

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one shard in memory at a time."""
        for f in self.shards:
            yield from load_file(self.path / f).items()

    def read(self, name: str) -> torch.Tensor:
        f = next(f for f, names in self.shards.items() if name in names)
        with safe_open(self.path / f, framework="pt") as h:
            return h.get_tensor(name)

    def shard_metadata(self, shard: str) -> dict[str, str] | None:
        with safe_open(self.path / shard, framework="pt") as h:
            return h.metadata()

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

