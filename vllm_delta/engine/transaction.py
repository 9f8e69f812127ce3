"""The one update transaction under both doors: ranks prepare while the engine serves, agree before any
write, and generation pauses only around a non-empty commit; a commit failing part-way leaves the
engine paused and faulted until an anchor commits everywhere. The doors differ only in their `Rpc`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar

from prometheus_client import REGISTRY
from pydantic import ValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_delta.engine import replicas
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.messages import (
    CommitReply,
    CoverageReply,
    Done,
    PrepareReply,
    PrepareRequest,
    ProbeReply,
    Reply,
    StatusReply,
)
from vllm_delta.engine.trace import PhaseTimes

logger = logging.getLogger("vllm.delta_updates")  # under vLLM's logger, beside its own lines
PREPARE_POLL_S = 0.05  # between polls of a background prepare: short next to any real prepare
POLL_S = 0.5  # how often a pending engine call looks at the engine's liveness flag
R = TypeVar("R", bound=Reply)
T = TypeVar("T")
# `(name, args)` -> every worker's raw reply; name is the worker method without its `delta_` prefix.
Rpc = Callable[[str, tuple], Awaitable[list[Any]]]


@dataclass
class Sync:
    """One update through the core: the door's phase times and what the ranks answered."""

    door: PhaseTimes = field(default_factory=PhaseTimes)
    id: str = ""  # the workers' request id
    wall_s: float = 0.0
    prepare_s: float = 0.0
    tokens_during_prepare: float | None = None
    prepared: list[PrepareReply] = field(default_factory=list)

    @contextmanager
    def timing(self) -> Iterator[None]:
        started = perf_counter()
        try:
            yield
        finally:
            self.wall_s += perf_counter() - started


class Transaction:
    """The update state of one engine, driven by a door."""

    def __init__(self, engine: Any, rpc: Rpc) -> None:
        self.engine = engine
        self._rpc = rpc
        self.lock = asyncio.Lock()
        self._peers_set = False
        # Tensors split across the DP engines of a MoE model, checked over all of them (set with the peers).
        self.across_dp: frozenset[str] | None = None
        # A commit failed part-way: generation stays paused and /health fails until an anchor commits.
        self.fault: dict[str, Any] | None = None
        # The startup probe's tensors whose loader cannot be served exactly: updates refused, /health fails.
        self.refused: dict[str, str] = {}
        self.last: dict[str, Any] | None = None  # the last successful sync's answer, with its trace

    async def call(self, name: str, *args: Any, reply: type[R]) -> list[R]:
        """`delta_<name>` on every worker of every DP replica, each reply validated as `reply`; an
        exception there (not a reported refusal) or a malformed reply is a 500."""
        try:
            raw = await while_alive(self.engine, self._rpc(name, args))
            return [reply.model_validate(r) for r in raw]
        except EngineDeadError:
            logger.error("delta updates: an engine core died during %s", name)
            raise  # vLLM's handler answers it and shuts the server down
        except ValidationError as exc:
            logger.error("delta updates: a worker's %s reply is malformed: %s", name, exc)
            raise UpdateError(
                500, "EngineError", f"delta_{name}: a worker's reply is malformed: {exc}"
            ) from exc
        except Exception as exc:
            logger.exception("delta updates: %s failed on a worker", name)
            raise UpdateError(500, "EngineError", f"delta_{name} failed on a worker: {exc}") from exc

    async def prepare(self, request: PrepareRequest) -> Sync:
        """Phase 1 on every rank, then their agreement; on any refusal (or the client going away) every
        rank drops what it staged."""
        sync = Sync(id=request.id)
        with sync.timing():
            try:
                with sync.door.phase("agree"):
                    await self.ensure_peers()
                tokens_before, polled = generation_tokens(), perf_counter()
                sync.prepared = prepared = await self._prepare(request)
                sync.prepare_s, tokens_after = perf_counter() - polled, generation_tokens()
                if tokens_before is not None and tokens_after is not None:
                    sync.tokens_during_prepare = tokens_after - tokens_before
                sync.door.add(
                    "prepare_wait", max(0.0, sync.prepare_s - replicas.worker_seconds(prepared, commit=False))
                )
                with sync.door.phase("agree"):
                    replicas.agree(prepared, self.across_dp)
            except BaseException:
                await self.abort(request.id)
                raise
        return sync

    async def _prepare(self, request: PrepareRequest) -> list[PrepareReply]:
        """The polls are cheap RPCs between engine steps; the sleeps hand the engine core back."""
        started = await self.call("prepare_start", request.wire(), reply=PrepareReply)
        if failed := [r for r in started if not r.ok]:
            return failed[:1]
        replies: dict[int, PrepareReply] = {}
        while True:
            for i, reply in enumerate(await self.call("prepare_poll", request.id, reply=PrepareReply)):
                if reply.done or not reply.ok:
                    replies.setdefault(i, reply)
            if len(replies) == len(started):
                return [replies[i] for i in range(len(started))]
            await asyncio.sleep(PREPARE_POLL_S)

    async def commit(self, sync: Sync, then: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
        """Phase 2: scatter what every rank staged, pausing generation (and dropping the stale prefix
        cache) when anything changed; `then` runs after a successful commit, before the resume. If a
        rank fails, generation stays paused and `fault` is set until an anchor commits everywhere.
        Returns the door's 200 (one summary for all ranks, the trace), kept as `last`."""
        with sync.timing():
            changed, started = bool(sync.prepared[0].total_changed), perf_counter()
            if changed and self.fault is None:  # a faulted engine is paused already
                try:
                    with sync.door.phase("pause"):
                        await while_alive(
                            self.engine, self.engine.pause_generation(mode="keep", clear_cache=True)
                        )
                except EngineDeadError:
                    raise
                except Exception as exc:
                    await self.abort(sync.id)
                    raise UpdateError(500, "EngineError", f"could not pause generation: {exc}") from exc
            committed: list[CommitReply] = []  # the RPC may raise before any reply
            try:
                called = perf_counter()
                committed = await self.call("commit", sync.id, reply=CommitReply)
                waited = perf_counter() - called - replicas.worker_seconds(committed, commit=True)
                sync.door.add("commit_wait", max(0.0, waited))
                if then is not None and replicas.first_failed(committed) is None:
                    await then()
            finally:
                failed = [r for r in committed if not r.ok] if committed else [Done(ok=False)]  # RPC raised
                if changed and failed:
                    self.fault = replicas.fault_of(failed)
                    logger.error("delta updates: commit failed; generation stays paused: %s", self.fault)
                elif changed:
                    if all(r.anchor for r in sync.prepared):
                        self.fault = None
                    if self.fault is None:
                        with sync.door.phase("resume"):
                            await while_alive(self.engine, self.engine.resume_generation())
            if (refused := replicas.first_failed(committed)) is not None:
                raise replicas.with_ranks(replicas.refusal(refused), committed)
            pause_s = perf_counter() - started if changed else 0.0
        result = {
            **replicas.summarize(sync.prepared, committed, pause_s),
            "prepare_s": sync.prepare_s,
            "tokens_during_prepare": sync.tokens_during_prepare,
            "trace": replicas.trace_of(sync.door.as_dict(), sync.prepared, committed, sync.wall_s),
        }
        self.last = {k: v for k, v in result.items() if k not in ("ranks", "replicas")}
        return result

    async def abort(self, request_id: str) -> None:
        """Drop a prepared update on every rank; a failure here must not hide the first error."""
        try:
            await self.call("abort", request_id, reply=Done)
        except (UpdateError, EngineDeadError):
            pass  # call() logged it, or there is nothing left to abort

    async def ensure_peers(self) -> None:
        """Once: every rank learns which elements lower ranks hold, so digests count each once (per DP
        replica, and over all DP engines for the tensors a MoE model splits across them)."""
        if self._peers_set:
            return
        coverages = await self.call("coverage", reply=CoverageReply)
        groups = replicas.by_replica([c.model_dump(exclude_none=True) for c in coverages])
        pairs = [[dp, group] for dp, group in groups.items()]
        args = [pairs[0][1]] if len(pairs) == 1 else [[], pairs]  # under DP, each replica's ranks apart
        checked = await self.call("set_peers", *args, reply=CoverageReply)
        try:
            self.across_dp = replicas.across_dp([c.model_dump(exclude_none=True) for c in checked])
        except ValueError as exc:
            raise UpdateError(500, "CoverageError", str(exc)) from None
        for bad in (c for c in checked if not c.coverage["ok"]):
            logger.error(
                "delta updates: placement coverage check failed on %s; updates are refused: %s",
                replicas.rank_id(bad),
                bad.coverage["errors"],
            )
        self._peers_set = True

    def start_probe(self) -> None:
        """Learn the placement on every rank now, in the background, before any update needs it."""

        async def probe() -> None:
            try:
                ranks = await self.call("probe", reply=ProbeReply)  # tensors a loader cannot serve exactly
                self.refused = {n: why for r in ranks for n, why in (r.refused or {}).items()}
                async with self.lock:  # then check, across ranks, that every element is held
                    await self.ensure_peers()
            except (UpdateError, EngineDeadError):
                pass  # call() logged it; the first update probes again and reports the error

        self._probe = asyncio.get_running_loop().create_task(probe())  # held: a task only weakly held may go

    async def status(self) -> dict[str, Any]:
        """`/delta_updates/status`: the ranks' version and lineage, health, placement and the last sync."""
        ranks = await self.call("status", reply=StatusReply)
        versions, runs = {r.version for r in ranks}, {r.run_id for r in ranks}  # run None: the checkpoint's
        dirty = [r.dirty_reason or "dirty" for r in ranks if r.dirty]
        agreed = len(versions) == 1 and len(runs) == 1
        return {
            "version": ranks[0].version if agreed else None,
            "run_id": ranks[0].run_id if agreed else None,
            "weight_version": await while_alive(self.engine, self.engine.get_weight_version()),
            "healthy": not dirty and agreed and self.fault is None and not self.refused,
            "dirty_reasons": dirty,
            "fault": self.fault,
            "placement": replicas.placement_summary([r.placement for r in ranks], self._peers_set),
            "last": self.last,
            "ranks": [r.model_dump(exclude={"status", "error"}) for r in ranks],
            "replicas": replicas.replica_status(ranks),
        }


def generation_tokens() -> float | None:
    """vLLM's `vllm:generation_tokens` counter in this process (all engines), or None where it is absent."""
    for metric in REGISTRY.collect():
        if metric.name == "vllm:generation_tokens":
            return sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return None


def engine_dead(engine: Any) -> bool:
    """Whether vLLM's client has seen an engine core die (False for clients without the flag)."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


async def while_alive(engine: Any, call: Awaitable[T]) -> T:
    """`await call`, unless an engine core dies first: then the call is cancelled and vLLM's own
    `EngineDeadError` raised (vLLM answers it and shuts down). Why: vLLM 0.32's async client never
    fails a pending utility call when an engine core dies, so the request would hang forever."""
    if engine_dead(engine):
        if asyncio.iscoroutine(call):
            call.close()
        raise EngineDeadError()
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if engine_dead(engine):
                task.cancel()
                raise EngineDeadError()
    except asyncio.CancelledError:
        task.cancel()
        raise
