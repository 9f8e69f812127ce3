"""The bodies of the delta routes, their size cap, the collective allowlist, and the containment of
paths under the root (a directory or a store prefix), checked before any engine process opens a file;
the workers then open it from the root's handle without following links (`wire.container.DeltaDir`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator
from starlette.requests import Request

from vllm_delta import settings
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import Message, PrepareRequest

if TYPE_CHECKING:
    from vllm_delta.transports.store import StoreURL


class DeltaUpdateRequest(Message):
    """One delta to apply: its version directory and the version lineage it claims."""

    path: StrictStr | None = Field(default=None, min_length=1)
    version: StrictInt = Field(ge=0)
    base_version: StrictInt | None = Field(default=None, ge=0)
    files: list[StrictStr] | None = None
    # "collective": the flushes arrive on the group the collective init joined; the manifest comes here.
    transport: Literal["disk", "collective"] = "disk"
    manifest: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _source(self) -> DeltaUpdateRequest:
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


class CollectiveInitRequest(Message):
    """`POST /delta_updates/collective/init`: join the trainer's group (the trainer is rank 0)."""

    master_addr: StrictStr = Field(min_length=1)
    master_port: StrictInt = Field(gt=0, lt=65536)
    world_size: StrictInt = Field(ge=2)
    rank_offset: StrictInt = Field(default=1, ge=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    # At most 600 s: the longest a stalled or hostile trainer may hold the workers at each step.
    timeout_s: StrictInt | StrictFloat = Field(default=120, gt=0, le=600)

    def check_ranks(self, ranks: int) -> None:
        """Refuse (400) a group that is not the trainer's ranks and every engine rank."""
        if self.world_size != self.rank_offset + ranks:
            message = f"world_size {self.world_size} != rank_offset {self.rank_offset} + {ranks} engine ranks"
            raise UpdateError(400, "InvalidRequest", message)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (413) past `max_bytes`, before it is all held in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise UpdateError(413, "RequestTooLarge", f"a body of {declared} B exceeds the {max_bytes} B limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise UpdateError(413, "RequestTooLarge", f"the body exceeds the {max_bytes} B limit")
    return bytes(body)


def check_collective(master_addr: str | None, allowed: Sequence[str] | None) -> None:
    """Refuse (403) collective transfers unless turned on (`master_addr=None` asks only that), and
    trainers outside the allowlist: IP addresses or networks, matched by value (so `::ffff:` forms do not
    slip past), or host names, matched as written, never resolved."""
    if not allowed:
        message = "collective updates are off: start the server with --delta-updates-collective-trainers ADDR"
        raise UpdateError(403, "CollectiveDisabled", message)
    if master_addr is not None and not any(_matches(master_addr, entry) for entry in allowed):
        message = f"master_addr {master_addr!r} is not in --delta-updates-collective-trainers"
        raise UpdateError(403, "TrainerNotAllowed", message)


def _matches(addr: str, entry: str) -> bool:
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return addr.lower() == entry.lower()
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip in network  # False across IP versions


def outside(message: str) -> UpdateError:
    return UpdateError(403, "PathOutsideRoot", message)


def resolve_version_dir(path: str, root: Path) -> Path:
    """The real path of a version directory, relative to `root` or absolute under it; every entry must
    resolve under `root` too (a flush file linking elsewhere would otherwise be read)."""
    if "\0" in path:
        raise UpdateError(400, "NotADeltaDirectory", "the path contains a NUL byte")
    resolved = Path(os.path.realpath(root / path))
    if not resolved.is_relative_to(root):
        raise outside(f"{path!r} resolves outside the delta-updates root")
    if not resolved.is_dir():
        raise UpdateError(
            400, "NotADeltaDirectory", f"{path!r} is not a directory under the delta-updates root"
        )
    for entry in resolved.iterdir():
        if not Path(os.path.realpath(entry)).is_relative_to(root):
            raise outside(f"{entry.name!r} in {path!r} links outside the delta-updates root")
    return resolved


# A store-relative path's segments: what version directory names are made of (`v000005`,
# `v000006-anchor`, `run-a/v000007`); anything else (a scheme's ":", "%", "?", "#", spaces) is refused.
_STORE_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


def store_version_key(path: str, root: StoreURL) -> str:
    """The key prefix of a version under a store root, for a store-relative `path` only: the engine
    fetches with its own credentials, so no other bucket, prefix or URL (no request forgery)."""
    if "\0" in path or "\\" in path:
        raise outside(f"{path!r} contains a NUL byte or a backslash")
    if ":" in path:
        raise outside(f"{path!r} names a URL or scheme; the engine reads only under {root}")
    if path.startswith("/"):
        raise outside(f"{path!r} is absolute; give a path relative to {root}")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise outside(f"{path!r} has an empty, '.' or '..' segment")
        if not _STORE_SEGMENT.fullmatch(segment):
            raise outside(f"{path!r}: segment {segment!r} is not made of letters, digits, '.', '_' or '-'")
    return root.key(path)


def prepare_request(
    body: DeltaUpdateRequest, root: Path | StoreURL, max_staged_bytes: int | None
) -> PrepareRequest:
    """The workers' request for `body`, its path checked under `root` (403 outside, 400 not a version
    directory). A store root sends only the checked relative path: the workers fetch from their own."""
    same = body.model_dump(include={"version", "base_version", "transport", "manifest"})
    request = PrepareRequest(id=uuid.uuid4().hex, max_staged_bytes=max_staged_bytes, **same)
    if body.transport == "collective":
        return request
    if isinstance(root, Path):
        path = resolve_version_dir(body.path, root)
        return request.model_copy(update={"path": str(path), "root": str(root), "files": body.files})
    store_version_key(body.path, root)
    if body.files is not None:
        raise UpdateError(
            400, "InvalidRequest", "`files` selects flushes of a disk delta; a store delta is read whole"
        )
    return request.model_copy(update={"store_path": body.path})


def delta_root() -> Path:
    """The `delta` backend's root, as `--delta-updates-root` exported it, resolved."""
    if not (value := settings.updates_root()):
        message = f"the delta backend needs a root: --delta-updates-root or {settings.UPDATES_ROOT}"
        raise UpdateError(500, "NotConfigured", message)
    return Path(os.path.realpath(value))
