"""The body of `POST /update_weights_delta` and the containment of its paths under the root.

Why here and not in the workers: a path outside `--delta-updates-root` must be refused before any
engine process opens a file, and symlinks are resolved so a link cannot lead out of the root.
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)


class DeltaUpdateRequest(BaseModel):
    """One delta to apply: its version directory and the version lineage it claims."""

    model_config = ConfigDict(extra="forbid")

    path: StrictStr | None = Field(default=None, min_length=1)
    version: StrictInt = Field(ge=0)
    base_version: StrictInt | None = Field(default=None, ge=0)
    files: list[StrictStr] | None = None
    # "collective": the flushes arrive by broadcast on the group set up by the collective init
    # route; the manifest comes in the request instead of a version directory.
    transport: Literal["disk", "collective"] = "disk"
    manifest: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _source(self) -> "DeltaUpdateRequest":
        if self.transport == "disk" and (self.path is None or self.manifest is not None):
            raise ValueError("a disk update needs `path` and no `manifest`")
        if self.transport == "collective" and (self.manifest is None or self.path is not None or self.files):
            raise ValueError("a collective update needs `manifest` and no `path` or `files`")
        return self

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: list[str] | None) -> list[str] | None:
        for name in files or ():
            if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise ValueError(f"file {name!r} is not a plain file name inside the version directory")
        return files


class CollectiveInitRequest(BaseModel):
    """`POST /delta_updates/collective/init`: join the trainer's group (the trainer is rank 0)."""

    model_config = ConfigDict(extra="forbid")

    master_addr: StrictStr = Field(min_length=1)
    master_port: StrictInt = Field(gt=0, lt=65536)
    world_size: StrictInt = Field(ge=2)
    rank_offset: StrictInt = Field(default=1, ge=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: StrictInt | StrictFloat = Field(default=120, gt=0)


class OutsideRootError(Exception):
    """A path that resolves outside `--delta-updates-root` (403)."""


class NotADeltaDirError(Exception):
    """A path under the root that is not a directory (400)."""


def resolve_version_dir(path: str, root: Path) -> Path:
    """The real path of a version directory, relative to `root` or absolute under it.

    Every entry of the directory must also resolve under `root`: a flush file or manifest that is
    a symlink to elsewhere would otherwise be read by the workers.
    """
    if "\0" in path:
        raise NotADeltaDirError("the path contains a NUL byte")
    resolved = Path(os.path.realpath(root / path))
    if not _inside(resolved, root):
        raise OutsideRootError(f"{path!r} resolves outside the delta-updates root")
    if not resolved.is_dir():
        raise NotADeltaDirError(f"{path!r} is not a directory under the delta-updates root")
    for entry in resolved.iterdir():
        if not _inside(Path(os.path.realpath(entry)), root):
            raise OutsideRootError(f"{entry.name!r} in {path!r} links outside the delta-updates root")
    return resolved


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
