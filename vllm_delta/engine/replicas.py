"""The ranks and DP replicas behind one API server: one RPC reaching every engine core (vLLM's DP client
answers only the first engine's), and their replies made one. A MoE model's DP engines are one world for
the tensors split across them (`across_dp`); each dense replica's digests add up on their own."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from vllm_delta.engine.digests import Ownership, check_coverage, check_partials
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import CommitReply, PrepareReply, Reply, StatusReply
from vllm_delta.engine.trace import PHASES, WORKER_COMMIT, WORKER_PREPARE, critical
from vllm_delta.wire.errors import DeltaError

DP_KEY = "dp"
R = TypeVar("R")


async def rpc_all(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """`method` on every worker of every engine core this server manages, each dict reply tagged."""
    core: Any = getattr(engine, "engine_core", None)
    ranks = list(getattr(core, "engine_ranks_managed", None) or [0])
    if len(ranks) == 1:
        per_engine = [await engine.collective_rpc(method, args=args)]
    else:
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    if len(per_engine) != len(ranks):
        raise RuntimeError(f"{method}: {len(per_engine)} engines answered, {len(ranks)} are managed")
    # collective_rpc answers in rank order: a reply is named by its place, so a refusal says who refused.
    return [
        {DP_KEY: dp, "rank": rank, **reply} if isinstance(reply, dict) else reply
        for dp, replies in zip(ranks, per_engine)
        for rank, reply in enumerate(replies)
    ]


def _dp(reply: Any) -> int:
    """A reply's DP index, typed or still a dict."""
    return (reply.get(DP_KEY) if isinstance(reply, Mapping) else reply.dp) or 0


def by_replica(replies: Sequence[R]) -> dict[int, list[R]]:
    """Replies grouped by DP index, in order."""
    groups: dict[int, list[R]] = {}
    for reply in replies:
        groups.setdefault(int(_dp(reply)), []).append(reply)
    return groups


def rank_id(reply: Reply) -> str:
    """A worker's name across replicas: its DP index and its rank in that replica's world."""
    return f"dp{_dp(reply)}:rank{reply.rank}"


def _kept(coverage: Mapping[str, Any], keep: Callable[[str], bool]) -> dict[str, Any]:
    return {n: lats for n, lats in coverage.items() if keep(n)}


def moe_world(
    groups: Mapping[int, Sequence[Mapping[str, Any]]], dp: int, rank: int, shapes: Mapping[str, Sequence[int]]
) -> tuple[Ownership, dict[str, Any], list[str]]:
    """This rank's ownership, the coverage verdict and the tensors split across a MoE model's DP engines
    (`groups`: each DP index's `delta_coverage` replies): a tensor every engine holds whole is owned and
    checked per engine; any other, and one no rank holds, over the whole world."""
    if sorted(groups) != list(range(len(groups))) or dp not in groups:
        raise ValueError(
            f"DP engines {sorted(groups)} answered, DP rank {dp} expected among 0..{len(groups) - 1}"
        )
    engines = [sorted(groups[d], key=lambda c: c["rank"]) for d in range(len(groups))]
    world = [c for engine in engines for c in engine]
    local = [c["rank"] for c in engines[dp]]
    if rank not in local:
        raise ValueError(f"no coverage from dp{dp}:rank{rank} among the DP engines' replies")
    me = sum(len(e) for e in engines[:dp]) + local.index(rank)  # this rank's place in (dp, rank) order
    held = [{n for c in engine for n, lats in c["coverage"].items() if lats} for engine in engines]
    broken = {n for engine in engines for n in check_coverage(engine, shapes)["errors"]}
    across = sorted(
        n for n in set().union(*held) & shapes.keys() if n in broken or not all(n in h for h in held)
    )  # not held whole by every engine
    split = set(across)
    whole = Ownership.from_coverages(
        [_kept(c["coverage"], lambda n: n not in split) for c in engines[dp]], local.index(rank)
    )
    spread = Ownership.from_coverages([_kept(c["coverage"], split.__contains__) for c in world], me)
    ownership = Ownership({**whole.lower, **spread.lower}, {**whole.shares, **spread.shares})
    nowhere = shapes.keys() - set().union(*held)  # a hole if any rank's loader read it, else ignored by vLLM
    report = check_coverage(world, {n: shapes[n] for n in (*across, *sorted(nowhere))})
    mine = check_coverage(engines[dp], {n: s for n, s in shapes.items() if n not in split | nowhere})
    errors = {**mine["errors"], **report["errors"]}
    return (
        ownership,
        {"ok": not errors, "errors": errors, "ignored": sorted({*report["ignored"], *mine["ignored"]})},
        across,
    )


def across_dp(replies: Sequence[Mapping[str, Any]]) -> frozenset[str] | None:
    """The tensors split across DP engines, which every engine must have worked out alike (None: each
    replica holds the whole model)."""
    sets = {tuple(r["across_dp"]) for r in replies if r.get("across_dp") is not None}  # each engine's rank 0
    if len(sets) > 1:
        raise ValueError("DP engines disagree on which tensors are split across them")
    return frozenset(sets.pop()) if sets else None


def digest_groups(
    replies: Sequence[dict[str, Any]], split: frozenset[str] | None
) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, replies) groups whose partial digests must each add up to the manifest (the first reply
    carries `expected`): each replica for what it holds whole, and all ranks for the `split` tensors."""
    replicas, split = by_replica(replies), split or frozenset()

    def only(group: list[dict[str, Any]], keep: Callable[[str], bool]) -> list[dict[str, Any]]:
        return [{**group[0], "expected": _kept(group[0].get("expected") or {}, keep)}, *group[1:]]

    groups = [
        (f"dp{dp}: " if len(replicas) > 1 else "", only(group, lambda n: n not in split))
        for dp, group in replicas.items()
    ]
    return [*groups, ("across DP engines: ", only(list(replies), split.__contains__))] if split else groups


def refusal(reply: Reply) -> UpdateError:
    return UpdateError.from_worker(reply.model_dump(include={"status", "error"}))


def first_failed(replies: Sequence[Reply]) -> Reply | None:
    return next((r for r in replies if not r.ok), None)


def with_ranks(err: UpdateError, replies: Sequence[Reply]) -> UpdateError:
    """`err` with every rank's outcome (`dp<i>:rank<r>` -> ok, status): which replica refused."""
    err.error["ranks"] = {
        rank_id(r): {"ok": r.ok, "status": r.status or (200 if r.ok else 500)} for r in replies
    }
    return err


def agree(prepared: Sequence[PrepareReply], split: frozenset[str] | None = None) -> None:
    """The ranks' prepares agree: none refused, and the partial digests add up (`digest_groups`); else
    the refusal, naming the replica, with every rank's outcome."""
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
    """The sync's trace: the critical rank's prepare and commit phases and the door's own, which add up
    to the wall time; each rank's phases; the wall time."""
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
    """The critical rank's seconds in the worker phases of prepare (or commit)."""
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


def placement_summary(placements: Sequence[dict[str, Any]], peers_checked: bool) -> dict[str, Any]:
    """The ranks' placement status as one: the slowest probe, the largest peak; ready once every rank
    probed and the coverage check ran (`peers_checked`), so an update then waits for no startup work."""
    ready = all(p["ready"] for p in placements)
    probed = {
        "probe_s": max(p["probe_s"] or 0.0 for p in placements),
        "probe_peak_bytes": max(p["probe_peak_bytes"] or 0 for p in placements),
        "fallback": sorted({n for p in placements for n in (p["fallback"] or {})}),
        "refused": {n: why for p in placements for n, why in (p.get("refused") or {}).items()},
    }
    return {
        "ready": ready and peers_checked,
        **(probed if ready else dict.fromkeys(probed)),
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
