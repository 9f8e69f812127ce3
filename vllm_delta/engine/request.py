"""The body of `POST /update_weights_delta` and the containment of its paths under the root.

Why here and not in the workers: a path outside `--delta-updates-root` must be refused before any
engine process opens a file, and symlinks are resolved so a link cannot lead out of the root.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator


class DeltaUpdateRequest(BaseModel):
    """One delta to apply: its version directory and the version lineage it claims."""

    model_config = ConfigDict(extra="forbid")

    path: StrictStr = Field(min_length=1)
    version: StrictInt = Field(ge=0)
    base_version: StrictInt | None = Field(default=None, ge=0)
    files: list[StrictStr] | None = None

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: list[str] | None) -> list[str] | None:
        for name in files or ():
            if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise ValueError(f"file {name!r} is not a plain file name inside the version directory")
        return files


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
