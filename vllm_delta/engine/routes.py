"""Our door over the transaction core: `POST /update_weights_delta`, `/delta_updates/{status,verify,
collective/init}` and the seed trainer's `POST /update_weights_from_disk`. It checks each request (its
key: vLLM's middleware guards only `/v1`-style paths; its path; the collective allowlist) and answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictStr
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_delta.engine.cli_args import DEFAULT_MAX_BODY_BYTES
from vllm_delta.engine.digests import mismatches
from vllm_delta.engine.http_errors import UpdateError, validated
from vllm_delta.engine.messages import JoinedReply, Message, StatusReply, VerifyReply
from vllm_delta.engine.metrics import answered, delta_metrics, observed, refused
from vllm_delta.engine.replicas import by_replica, digest_groups, first_failed, refusal, rpc_all
from vllm_delta.engine.request import (
    CollectiveInitRequest,
    DeltaUpdateRequest,
    check_collective,
    prepare_request,
    read_body,
)
from vllm_delta.engine.transaction import Transaction
from vllm_delta.transports.store import StoreURL

router = APIRouter()


class DeltaUpdater(Transaction):
    """Our route's door over the core: our worker extension's `delta_<name>` on every worker."""

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
        # vLLM's own bearer-key check (sha256 digests, constant-time compare).
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
        async with self.lock:
            return await self.commit(await self.prepare(request))

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
            why = "the collective transport cannot serve data-parallel replicas: use a disk or store root"
            raise UpdateError(400, "InvalidRequest", why)
        body.check_ranks(len(ranks))
        async with self.lock:
            joined = await self.call("collective_init", body.model_dump(), reply=JoinedReply)
        if (failed := first_failed(joined)) is not None:
            raise refusal(failed)
        return {"ranks": [r.group_rank for r in joined], "world_size": body.world_size}


def _digests_checked(group: list[dict[str, Any]]) -> dict[str, Any]:
    checked, bad = mismatches(group)
    return {"digests_checked": checked, "digest_mismatched": [b[0] for b in bad]}


async def _on_updater(
    request: Request, method: Callable[..., Awaitable[dict[str, Any]]], model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """`method` on the updater once the request's key is checked, given the body as `model` (a malformed
    one is a 400, one past the size cap a 413)."""
    updater: DeltaUpdater = request.app.state.delta_updater
    updater.authorize(request)
    if model is None:
        return await method(updater)
    return await method(updater, validated(model, await read_body(request, updater.max_body_bytes)))


@router.post("/update_weights_delta")
async def update_weights_delta(request: Request) -> JSONResponse:
    async def update(updater: DeltaUpdater, body: DeltaUpdateRequest) -> dict[str, Any]:
        try:
            return observed(await updater.update(body), "update")
        except EngineDeadError:
            delta_metrics().failed(500)
            raise

    return await answered(_on_updater(request, update, DeltaUpdateRequest), "update")


@router.post("/delta_updates/collective/init")
async def delta_collective_init(request: Request) -> JSONResponse:
    init = _on_updater(request, DeltaUpdater.collective_init, CollectiveInitRequest)
    return await answered(init, "collective init", count=False)


@router.post("/delta_updates/verify")
async def delta_updates_verify(request: Request) -> JSONResponse:
    return await answered(_on_updater(request, DeltaUpdater.verify))


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    return await answered(_on_updater(request, DeltaUpdater.status))


class SeedPush(Message):
    """The seed trainer's push (slime's `update_weights_from_disk(load_format="delta")`): the files of
    `DIR/weight_v{N:06d}/`, a version possibly in several parts (its encodings overwrite, so a re-applied
    version is idempotent); the trainer reads only the HTTP status of an SGLang-shaped answer."""

    model_path: StrictStr = Field(min_length=1)
    load_format: Literal["delta"]
    weight_version: StrictStr = Field(pattern=r"^[0-9]{1,18}$")
    files: list[StrictStr] = Field(min_length=1)  # the seed's receiver needs them too

    def as_update(self) -> DeltaUpdateRequest:
        """Our request for the same directory, files and version (a bad file name: a 400, as ours)."""
        body = {"path": self.model_path, "version": int(self.weight_version), "files": self.files}
        return validated(DeltaUpdateRequest, body)


def _seed_answer(status: int, message: str, **extra: Any) -> JSONResponse:
    body = {"success": status == 200, "message": message, "num_paused_requests": 0, **extra}
    return JSONResponse(body, status_code=status)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    async def push(updater: DeltaUpdater, body: SeedPush) -> dict[str, Any]:
        return observed(await updater.update(body.as_update()), "seed push")

    try:
        result = await _on_updater(request, push, SeedPush)
    except UpdateError as err:
        refused(err, "seed push")
        return _seed_answer(err.status, f"{err.error['type']}: {err.error['message']}", error=err.error)
    return _seed_answer(
        200, f"applied version {result['version']}: {result['changed']} changed", delta=result
    )


def guard_health(app: FastAPI) -> None:
    """`/health` answers 503 while a failed commit left weights suspect, so load balancers drain us."""

    @app.middleware("http")
    async def delta_health(request: Request, call_next):
        updater = getattr(request.app.state, "delta_updater", None)
        if request.url.path != "/health" or updater is None:
            return await call_next(request)
        if updater.fault is not None:
            why = "a delta commit failed; weights are suspect"
            return UpdateError(503, "DeltaCommitFault", why, fault=updater.fault).response()
        if updater.refused:
            why = "delta updates cannot be served exactly for some tensors"
            return UpdateError(503, "UnservableLoader", why, refused=updater.refused).response()
        return await call_next(request)
