"""The data-parallel replicas behind one API server: one RPC that reaches every engine core, its
replies tagged with their DP index, and the per-replica grouping the route checks digests by.

Why not `AsyncLLM.collective_rpc`: under DP with vLLM's internal load balancer, `DPLBAsyncMPClient`
sends a utility call to every engine but returns only the first engine's replies
(`call_utility_async`), so another replica's refusal or failed commit would be lost.

A dense DP replica is an engine of its own holding the whole model, so its ranks' counted-once
digests must add up on their own (a diverged replica is refused, not hidden by another's copy).
The DP engines of a MoE model are one world (`FusedMoEParallelConfig.make` splits the experts over
DP x TP): a tensor every engine holds whole is checked per engine, one split across them
(`across_dp`) over the whole world, ranks ordered (dp, rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from vllm_delta.engine.digests import Ownership, check_coverage

DP_KEY = "dp"
R = TypeVar("R")


async def rpc_all(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """`method` on every worker of every engine core this server manages; each dict reply tagged `dp` and
    `rank`."""
    core = getattr(engine, "engine_core", None)
    ranks = list(getattr(core, "engine_ranks_managed", None) or [0])
    if len(ranks) == 1:
        per_engine = [await engine.collective_rpc(method, args=args)]
    else:
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    if len(per_engine) != len(ranks):
        raise RuntimeError(f"{method}: {len(per_engine)} engines answered, {len(ranks)} are managed")
    # collective_rpc answers in the engine's rank order; a reply that does not name its rank (an
    # error reply) is named by its place, so a refusal says which worker refused.
    return [
        {DP_KEY: dp, "rank": rank, **reply} if isinstance(reply, dict) else reply
        for dp, replies in zip(ranks, per_engine)
        for rank, reply in enumerate(replies)
    ]


def _field(reply: Any, key: str, default: Any = None) -> Any:
    """A field of a reply, typed (engine/messages.py) or still a dict; `default` where unset."""
    value = reply.get(key) if isinstance(reply, Mapping) else getattr(reply, key, None)
    return default if value is None else value


def by_replica(replies: Sequence[R]) -> dict[int, list[R]]:
    """Replies grouped by DP index (each group in its workers' order)."""
    groups: dict[int, list[R]] = {}
    for reply in replies:
        groups.setdefault(int(_field(reply, DP_KEY, 0)), []).append(reply)
    return groups


def rank_id(reply: Any) -> str:
    """A worker's name across replicas: its DP index and its rank in that replica's world."""
    return f"dp{_field(reply, DP_KEY, 0)}:rank{_field(reply, 'rank')}"


def _restricted(coverage: Mapping[str, Any], keep: Callable[[str], bool]) -> dict[str, Any]:
    return {n: lats for n, lats in coverage.items() if keep(n)}


def moe_world(
    groups: Mapping[int, Sequence[Mapping[str, Any]]], dp: int, rank: int, shapes: Mapping[str, Sequence[int]]
) -> tuple[Ownership, dict[str, Any], list[str]]:
    """This rank's counted-once ownership, the coverage verdict and the tensors split across DP
    engines, for the DP engines of a MoE model (`groups`: each DP index's `delta_coverage` replies).

    A tensor that every engine's ranks hold whole is owned within the engine (each engine is checked
    on its own); any other is owned across the world, ranks in (dp, rank) order, and its coverage
    (no element held by no rank, or unevenly) is judged over the whole world, as is that of a tensor
    no rank holds (a hole where some rank's loader read it; one vLLM ignores where none did).
    """
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
        [_restricted(c["coverage"], lambda n: n not in split) for c in engines[dp]], local.index(rank)
    )
    spread = Ownership.from_coverages([_restricted(c["coverage"], split.__contains__) for c in world], me)
    ownership = Ownership({**whole.lower, **spread.lower}, {**whole.shares, **spread.shares})
    nowhere = shapes.keys() - set().union(*held)  # a hole if any rank's loader read it, else ignored by vLLM
    report = check_coverage(world, {n: shapes[n] for n in (*across, *sorted(nowhere))})
    mine = check_coverage(
        engines[dp], {n: s for n, s in shapes.items() if n not in split and n not in nowhere}
    )
    report = {
        "ok": report["ok"] and mine["ok"],
        "errors": {**mine["errors"], **report["errors"]},
        "ignored": sorted({*report["ignored"], *mine["ignored"]}),
    }
    return ownership, report, across


def across_dp(replies: Sequence[Mapping[str, Any]]) -> frozenset[str] | None:
    """The tensors split across DP engines, from `delta_set_peers` replies (None: each replica holds the
    whole model). Every engine must have worked out the same set."""
    sets = {tuple(r["across_dp"]) for r in replies if r.get("across_dp") is not None}  # each engine's rank 0
    if len(sets) > 1:
        raise ValueError("DP engines disagree on which tensors are split across them")
    return frozenset(sets.pop()) if sets else None


def digest_groups(
    replies: Sequence[dict[str, Any]], split: frozenset[str] | None
) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, replies) groups whose partial digests must each add up to the manifest: every replica on
    its own, for the tensors it holds whole; and, where `split` names tensors split across the DP
    engines, all ranks together for those. The first reply of a group carries its `expected`."""
    replicas = by_replica(replies)
    label = (lambda dp: f"dp{dp}: ") if len(replicas) > 1 else (lambda dp: "")
    if not split:
        return [(label(dp), group) for dp, group in replicas.items()]

    def only(group: list[dict[str, Any]], keep: Callable[[str], bool]) -> list[dict[str, Any]]:
        head = {**group[0], "expected": _restricted(group[0].get("expected") or {}, keep)}
        return [head, *group[1:]]

    groups = [(label(dp), only(group, lambda n: n not in split)) for dp, group in replicas.items()]
    return [*groups, ("across DP engines: ", only(list(replies), split.__contains__))]
