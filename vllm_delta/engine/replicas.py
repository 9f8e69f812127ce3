"""The data-parallel replicas behind one API server: one RPC that reaches every engine core, its
replies tagged with their DP index, and the per-replica grouping the route checks digests by.

Why not `AsyncLLM.collective_rpc`: under `--data-parallel-size N` with vLLM's internal load balancer
the client is `DPLBAsyncMPClient`, whose `call_utility_async` sends a utility call to every engine
core but returns only the first engine's replies (vllm/v1/engine/core_client.py:1699,
`DPLBAsyncMPClient.call_utility_async`: `(await self.call_utility_all_async(...))[0]`), so another
replica's refusal or failed commit would be lost. `call_utility_all_async` answers one list of
worker replies per engine, in the order of `engine_ranks_managed` (each engine's DP rank).

Each dense DP replica is an engine of its own (vLLM runs it as DP=1 in its own TP world,
`ParallelConfig.reconfigure_for_independent_dp_rank`) holding the whole model, so its ranks'
counted-once digests must add up to the manifest on their own: a replica that diverged is then
refused, not hidden behind another replica's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DP_KEY = "dp"


async def rpc_all(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """`method` on every worker of every engine core this server manages; each dict reply tagged `dp`."""
    core = getattr(engine, "engine_core", None)
    ranks = list(getattr(core, "engine_ranks_managed", None) or [0])
    if len(ranks) == 1:
        per_engine = [await engine.collective_rpc(method, args=args)]
    else:
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    if len(per_engine) != len(ranks):
        raise RuntimeError(f"{method}: {len(per_engine)} engines answered, {len(ranks)} are managed")
    return [{DP_KEY: dp, **reply} if isinstance(reply, dict) else reply
            for dp, replies in zip(ranks, per_engine) for reply in replies]


def by_replica(replies: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Replies grouped by DP index (each group in its workers' order)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for reply in replies:
        groups.setdefault(int(reply.get(DP_KEY, 0)), []).append(reply)
    return groups


def rank_id(reply: dict[str, Any]) -> str:
    """A worker's name across replicas: its DP index and its rank in that replica's world."""
    return f"dp{reply.get(DP_KEY, 0)}:rank{reply.get('rank')}"
