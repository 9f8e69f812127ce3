"""Our route, one door over the transaction core: `POST /update_weights_delta`, `GET /delta_updates/status`,
`POST /delta_updates/verify` and `POST /delta_updates/collective/init`.

Why a thin door: the update itself (prepare while serving, agreement, pause, commit, fault) is the
core's (engine/transaction.py); this module checks the request (authentication, its path under
the root, the collective allowlist) and answers. The routes exist only when `vllm serve` got
`--enable-delta-updates`, and they obey `--api-key` themselves, because vLLM's authentication
middleware guards only the `/v1`-style prefixes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_delta.engine.cli_args import DEFAULT_MAX_BODY_BYTES
from vllm_delta.engine.digests import mismatches
from vllm_delta.engine.http_errors import M, UpdateError, validated
from vllm_delta.engine.messages import JoinedReply, StatusReply, VerifyReply
from vllm_delta.engine.metrics import delta_metrics, observed, refused
from vllm_delta.engine.replicas import by_replica, digest_groups, rpc_all
from vllm_delta.engine.request import (
    CollectiveInitRequest,
    DeltaUpdateRequest,
    check_collective,
    prepare_request,
    read_body,
)
from vllm_delta.engine.summary import first_failed, refusal
from vllm_delta.engine.transaction import Sync, Transaction
from vllm_delta.transports.store import StoreURL

router = APIRouter()


class DeltaUpdater(Transaction):
    """Our route's door over the core: the request checks, and the answers; it reaches `delta_<name>`
    of our worker extension on every worker of every DP replica."""

    def __init__(
        self,
        engine: Any,
        root: Path | StoreURL,
        max_staged_bytes: int,
        tokens: list[str],
        *,
        collective_trainers: list[str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        super().__init__(engine, lambda name, args: rpc_all(engine, f"delta_{name}", args))
        self.root, self.max_staged_bytes, self.max_body_bytes = root, max_staged_bytes, max_body_bytes
        self.collective_trainers = collective_trainers
        # vLLM's own bearer-key check (sha256 digests, constant-time compare); its middleware itself
        # guards only the `/v1` prefix, so these routes call it.
        self._auth = AuthenticationMiddleware(None, tokens) if tokens else None

    def authorize(self, request: Request) -> None:
        """Refuse (401) a request without a valid `Authorization: Bearer` key, if keys are set."""
        if self._auth is not None and not self._auth.verify_token(request.headers):
            raise UpdateError(401, "Unauthorized", "missing or wrong API key")

    async def update(self, body: DeltaUpdateRequest) -> dict[str, Any]:
        if body.transport == "collective":
            check_collective(None, self.collective_trainers)
        request = prepare_request(body, self.root, self.max_staged_bytes)
        if self.refused:
            raise UpdateError(500, "UnservableLoader", f"delta updates refused at startup: {self.refused}")
        sync = Sync()
        async with self.lock:
            await self.prepare(request, sync)
            committed, pause_s = await self.commit(request.id, sync)
        return self.answer(sync, committed, pause_s)

    async def verify(self) -> dict[str, Any]:
        """Full verify of the served weights against the digests and hashes of the updates so far."""
        async with self.lock:
            await self.ensure_peers()
            typed = await self.call("verify", reply=VerifyReply)
        replies = [r.model_dump(exclude_none=True) for r in typed]
        # Each replica against the digests of what it holds whole, then (a MoE model) the tensors split
        # across the DP engines against all of them.
        groups = digest_groups(replies, self.across_dp)
        replicas = []
        for (_, group), (dp, ranks) in zip(groups, by_replica(replies).items()):
            hashes = sorted({n for r in ranks for n in r["hash_mismatched"]})
            replicas.append({"dp": dp, **_digests_checked(group), "hash_mismatched": hashes})
        extra = {"across_dp": _digests_checked(groups[-1][1])} if self.across_dp else {}
        checks = [*replicas, *extra.values()]
        digest_bad = sorted({n for r in checks for n in r["digest_mismatched"]})
        hash_bad = sorted({n for r in replicas for n in r["hash_mismatched"]})
        return {
            "ok": not digest_bad and not hash_bad,
            "digests_checked": sum(r["digests_checked"] for r in checks),
            "digest_mismatched": digest_bad,
            "hashes_checked": sum(r.hash_checked for r in typed),
            "hash_mismatched": hash_bad,
            "verify_s": max(r.verify_s for r in typed),
            "replicas": replicas,
            **extra,
        }

    async def collective_init(self, body: CollectiveInitRequest) -> dict[str, Any]:
        """Every worker joins the trainer's group (each worker is rank `rank_offset + its rank`)."""
        check_collective(body.master_addr, self.collective_trainers)
        ranks = await self.call("status", reply=StatusReply)
        if len(by_replica(ranks)) > 1:  # each worker would join as rank_offset + its rank in its own replica
            raise UpdateError(
                400,
                "InvalidRequest",
                "the collective transport cannot serve data-parallel "
                "replicas: their workers would take the same group ranks; use a disk or store root",
            )
        body.check_ranks(len(ranks))
        async with self.lock:
            joined = await self.call("collective_init", body.model_dump(), reply=JoinedReply)
        if (failed := first_failed(joined)) is not None:
            raise refusal(failed)
        return {"ranks": [r.group_rank for r in joined], "world_size": body.world_size}


def _digests_checked(group: list[dict[str, Any]]) -> dict[str, Any]:
    checked, bad = mismatches(group)
    return {"digests_checked": checked, "digest_mismatched": [b[0] for b in bad]}


def _updater(request: Request) -> DeltaUpdater:
    updater: DeltaUpdater = request.app.state.delta_updater
    updater.authorize(request)
    return updater


async def _body(request: Request, model: type[M]) -> M:
    """The request body as `model`; a malformed one is a 400, one past the size cap a 413."""
    return validated(model, await read_body(request, request.app.state.delta_updater.max_body_bytes))


async def _answer(
    request: Request, action: Callable[[DeltaUpdater], Awaitable[Any]], what: str = "", count: bool = True
) -> JSONResponse:
    """`action`'s answer, or its refusal's (logged, and counted with `count`, when `what` names it)."""
    try:
        return JSONResponse(await action(_updater(request)))
    except UpdateError as err:
        return (refused(err, what, count) if what else err).response()


@router.post("/update_weights_delta")
async def update_weights_delta(request: Request) -> JSONResponse:
    async def update(updater: DeltaUpdater) -> dict[str, Any]:
        try:
            return observed(await updater.update(await _body(request, DeltaUpdateRequest)), "update")
        except EngineDeadError:
            delta_metrics().failed(500)
            raise

    return await _answer(request, update, "update")


@router.post("/delta_updates/collective/init")
async def delta_collective_init(request: Request) -> JSONResponse:
    async def init(updater: DeltaUpdater) -> dict[str, Any]:
        return await updater.collective_init(await _body(request, CollectiveInitRequest))

    return await _answer(request, init, "collective init", count=False)


@router.post("/delta_updates/verify")
async def delta_updates_verify(request: Request) -> JSONResponse:
    return await _answer(request, DeltaUpdater.verify)


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    return await _answer(request, DeltaUpdater.status)


def guard_health(app: FastAPI) -> None:
    """`/health` answers 503 while a failed commit left weights suspect, so load balancers drain us."""

    @app.middleware("http")
    async def delta_health(request: Request, call_next):
        updater = getattr(request.app.state, "delta_updater", None)
        if request.url.path == "/health" and updater is not None and updater.fault is not None:
            return UpdateError(
                503, "DeltaCommitFault", "a delta commit failed; weights are suspect", fault=updater.fault
            ).response()
        if request.url.path == "/health" and updater is not None and updater.refused:
            return UpdateError(
                503,
                "UnservableLoader",
                "delta updates cannot be served exactly for some tensors",
                refused=updater.refused,
            ).response()
        return await call_next(request)
