"""The typed messages between the API server (either door) and the workers. `collective_rpc` carries
plain dicts, so each side validates what it receives and a renamed field fails at the boundary; payloads
whose shape another module owns (digests, coverage, placement) stay dicts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_delta.engine.http_errors import UpdateError


class Message(BaseModel):
    """A message or request body: a field one side renamed is refused, not passed over silently."""

    model_config = ConfigDict(extra="forbid")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class PrepareRequest(Message):
    """Phase 1 of one update on every rank: where the delta is and which version it claims."""

    id: str
    version: int = Field(ge=0)
    base_version: int | None = None
    # The bound on everything one update stages (413 past it); None: the worker's own.
    max_staged_bytes: int | None = Field(default=None, gt=0)
    transport: Literal["disk", "collective"] = "disk"
    manifest: dict[str, Any] | None = None  # collective: the trainer's manifest
    store_path: str | None = None  # a store root: the version's path relative to it
    path: str | None = None  # disk: the version directory, already checked to be under `root`
    root: str | None = None
    files: list[str] | None = None


class ErrorBody(Message):
    """The route's JSON error body, as a worker reports it (`fault`: a commit that failed part-way)."""

    type: str
    message: str
    file: str | None = None
    param: str | None = None
    fault: dict[str, Any] | None = None


class Reply(Message):
    """What every worker reply carries (`replicas.rpc_all` sets `dp`, and `rank` where it is missing)."""

    ok: bool = True
    status: int | None = None
    error: ErrorBody | None = None
    dp: int | None = None
    rank: int | None = None


def failure(status: int, exc: BaseException, **extra: Any) -> dict[str, Any]:
    """A refusal as a worker sends it: the exception's type, reason (a `DeltaError`'s) or text, and where."""
    where = {"file": getattr(exc, "file", None), "param": getattr(exc, "param", None)}
    return UpdateError(status, type(exc).__name__, str(getattr(exc, "reason", exc)), **where, **extra).reply()


class PrepareReply(Reply):
    """`delta_prepare_start` (not `done`), then `delta_prepare_poll`: this rank's staged update, its
    counted-once partial `digests` (rank 0: the manifest's `expected`) and its `phases`."""

    done: bool = True
    prepare_s: float | None = None
    changed: int = 0
    total_changed: int = 0
    bytes_read: int = 0
    decode_s: float = 0.0
    fallback: list[str] = Field(default_factory=list)
    replay: bool = False
    anchor: bool = False
    digests: dict[str, Any] = Field(default_factory=dict)
    staged_bytes: int = 0
    expected: dict[str, Any] | None = None
    phases: dict[str, float] = Field(default_factory=dict)


class CommitReply(Reply):
    """`delta_commit`: the version now served and this rank's seconds per commit phase."""

    apply_s: float = 0.0
    version: int | None = None
    phases: dict[str, float] = Field(default_factory=dict)


class CoverageReply(Reply):
    """`delta_coverage`: which checkpoint elements this rank holds, for its peers; `delta_set_peers`: the
    coverage verdict, and (MoE under DP) the tensors split across engines."""

    coverage: dict[str, Any] = Field(default_factory=dict)
    unread: list[str] = Field(default_factory=list)
    fallback: list[str] = Field(default_factory=list)
    map_errors: Any = None
    across_dp: list[str] | None = None


class ProbeReply(Reply):
    """`delta_probe`: the placement status once learned (apply.DeltaApplier.placement_status)."""

    model_config = ConfigDict(extra="allow")  # the placement status' own keys
    refused: dict[str, str] | None = None


class StatusReply(Reply):
    """`delta_status`: this rank's version, lineage, health and placement."""

    version: int
    run_id: str | None = None
    dirty: bool = False
    dirty_reason: str | None = None
    fault: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    placement: dict[str, Any] = Field(default_factory=dict)
    fallback: dict[str, str] | None = None  # tensor -> why its loader is replayed


class VerifyReply(Reply):
    """`delta_verify`: this rank's whole-tensor digests and post-hash checks of the served weights."""

    digests: dict[str, Any] = Field(default_factory=dict)
    hash_checked: int = 0
    hash_mismatched: list[str] = Field(default_factory=list)
    verify_s: float = 0.0
    expected: dict[str, Any] | None = None


class JoinedReply(Reply):
    """`delta_collective_init`: this rank's place in the trainer's group."""

    group_rank: int | None = None


class Done(Reply):
    """A reply that says only whether it worked (`delta_abort`, the backend's `end_session`)."""
