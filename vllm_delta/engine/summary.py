"""What the transaction core makes of its ranks' typed replies: one answer, one refusal, one fault.

Why pure functions apart from the core: the doors' answers (the route's 200, the backend's finish,
`/delta_updates/status`) and the offline backend's on-worker agreement read them too, and they
are tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import CommitReply, PrepareReply, Reply, StatusReply
from vllm_delta.engine.replicas import by_replica, digest_groups, rank_id
from vllm_delta.engine.trace import PHASES, WORKER_COMMIT, WORKER_PREPARE, critical
from vllm_delta.wire.errors import DeltaError


def refusal(reply: Reply) -> UpdateError:
    """The route's error for a rank's refusal."""
    return UpdateError.from_worker(reply.model_dump(include={"status", "error"}))


def first_failed(replies: Sequence[Reply]) -> Reply | None:
    return next((r for r in replies if not r.ok), None)


def with_ranks(err: UpdateError, replies: Sequence[Reply]) -> UpdateError:
    """`err` with every rank's outcome (`dp<i>:rank<r>` -> ok, status), so a client sees which replica
    refused."""
    err.error["ranks"] = {rank_id(r): {"ok": r.ok, "status": r.http_status} for r in replies}
    return err


def agree(prepared: Sequence[PrepareReply], split: frozenset[str] | None = None) -> None:
    """The ranks' prepares agree: none refused, and each replica's partial digests add up to the manifest
    (those of tensors `split` across a MoE model's DP engines over all of them); else the refusal, naming
    the replica, with every rank's outcome."""
    if (failed := first_failed(prepared)) is not None:
        raise with_ranks(refusal(failed), prepared)
    partials = [r.model_dump(include={"dp", "rank", "digests", "expected"}) for r in prepared]
    for where, group in digest_groups(partials, split):
        try:
            check_partials(group)
        except DeltaError as exc:
            raise with_ranks(
                UpdateError(exc.http_status, type(exc).__name__, where + exc.reason, param=exc.param),
                prepared,
            ) from None


def fault_of(failed: Sequence[Reply]) -> dict[str, Any]:
    """One fault record from the failed ranks' commit replies: the version, where, what is suspect."""
    faults = [(r.error.fault if r.error else None) or {} for r in failed]
    return {
        "version": next((f["version"] for f in faults if "version" in f), None),
        "failed_at": next((f["failed_at"] for f in faults if f.get("failed_at")), None),
        "suspect": sorted({n for f in faults for n in f.get("suspect", [])}),
        "ranks": [r.rank for r in failed],
        "rank_ids": [rank_id(r) for r in failed],
    }


def trace_of(
    door: dict[str, float], prepared: Sequence[PrepareReply], committed: Sequence[CommitReply], wall_s: float
) -> dict[str, Any]:
    """The sync's trace: the prepare's and the commit's critical rank's phases and the door's own, which
    add up to the wall time; each rank's phases; and the wall time."""
    ranks: list[dict[str, Any]] = [
        {"rank": rank_id(p), "phases": {**p.phases, **c.phases}} for p, c in zip(prepared, committed)
    ]
    timed = {
        **critical((p.phases for p in prepared), WORKER_PREPARE),
        **critical((c.phases for c in committed), WORKER_COMMIT),
        **door,
    }
    return {"phases": {p: timed[p] for p in PHASES if p in timed}, "ranks": ranks, "wall_s": round(wall_s, 6)}


def worker_seconds(replies: Sequence[PrepareReply | CommitReply], commit: bool) -> float:
    """The critical rank's seconds in the worker phases of prepare (or commit): what the door waited on."""
    return sum(critical((r.phases for r in replies), WORKER_COMMIT if commit else WORKER_PREPARE).values())


def summarize(
    prepared: Sequence[PrepareReply], committed: Sequence[CommitReply], pause_s: float
) -> dict[str, Any]:
    """One answer for all ranks: the slowest rank's times, the largest read, the union of fallbacks."""
    versions = {r.version for r in committed}
    if len(versions) != 1:
        raise UpdateError(
            500, "EngineError", f"ranks committed different versions: {sorted(versions, key=str)}"
        )
    ranks = [
        {
            **p.model_dump(exclude_none=True, exclude={"ok", "done", "phases"}),
            **c.model_dump(exclude_none=True, exclude={"ok", "phases"}),
        }
        for p, c in zip(prepared, committed)
    ]
    return {
        "version": versions.pop(),
        "changed": prepared[0].total_changed,
        "bytes_read": max(r.bytes_read for r in prepared),
        "decode_s": max(r.decode_s for r in prepared),
        "apply_s": max(r.apply_s for r in committed),
        "pause_s": pause_s,
        "replay": all(r.replay for r in prepared),
        "fallback": sorted({name for r in prepared for name in r.fallback}),
        "ranks": ranks,
        "replicas": [
            {"dp": dp, "version": group[0].version, "ranks": len(group)}
            for dp, group in by_replica(committed).items()
        ],
    }


def refused_of(ranks: Sequence[Reply]) -> dict[str, str]:
    """Tensors whose loader a rank cannot serve exactly (engine/fallback.py), with the reason."""
    return {n: reason for r in ranks for n, reason in (getattr(r, "refused", None) or {}).items()}


def placement_summary(placements: Sequence[dict[str, Any]], peers_checked: bool) -> dict[str, Any]:
    """The ranks' placement status as one: the slowest probe, the largest peak; ready when every rank
    probed and the cross-rank coverage check ran (`peers_checked`): it holds the update lock, so an
    update sent as soon as `ready` turns true waits for no startup work."""
    ready = all(p["ready"] for p in placements)
    refused = {n: why for p in placements for n, why in (p.get("refused") or {}).items()}
    return {
        "ready": ready and peers_checked,
        "probe_s": max((p["probe_s"] or 0.0 for p in placements), default=None) if ready else None,
        "probe_peak_bytes": max((p["probe_peak_bytes"] or 0 for p in placements), default=None)
        if ready
        else None,
        "fallback": sorted({n for p in placements for n in (p["fallback"] or {})}) if ready else None,
        "refused": refused if ready else None,
        "transformed": sorted({n for p in placements for n in p["transformed"]}),
        "in_pause": {n: why for p in placements for n, why in (p.get("in_pause") or {}).items()},
        "coverage": placements[0].get("coverage"),
    }  # the same check on every rank


def replica_status(ranks: Sequence[StatusReply]) -> list[dict[str, Any]]:
    """Per DP replica: its version (None if its ranks disagree) and whether it is clean."""
    out = []
    for dp, group in by_replica(ranks).items():
        versions = {r.version for r in group}
        version = versions.pop() if len(versions) == 1 else None
        out.append({"dp": dp, "version": version, "dirty": any(r.dirty for r in group), "ranks": len(group)})
    return out
