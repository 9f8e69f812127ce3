"""Front end of the `delta` backend, one door over the transaction core: vLLM's own `/update_weights` and
`/finish_weight_update`, answered the way `POST /update_weights_delta` answers.

Why replace these two routes (same paths, same bodies, same engine calls, vLLM's own operation
metrics): vLLM's versions turn every worker error into a 500 and cannot hold generation around a
commit. Here `/update_weights` is the core's prepare (every worker prepares on a background thread
while the engine keeps generating, then the ranks agree) and `/finish_weight_update` its commit
(generation paused only around a non-empty delta, a failed commit leaving the engine paused and
faulted until an anchor), both reaching the workers through our worker RPC
(weight_transfer/worker_engine.worker_rpc). vLLM's own `finish_weight_update` then closes the
session and sets `weight_version`; a refusal or a failed commit closes it the way vLLM does when
its `update_weights` raises (`end_session`). They exist only when `--weight-transfer-config`
selects `delta`, in dev mode (where vLLM mounts its routes), and when our endpoint plugin is
allowlisted. One update or commit runs at a time, so no commit writes weights a prepare is reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from vllm_delta.backend_names import is_ours
from vllm_delta.engine.http_errors import UpdateError, bad_request
from vllm_delta.engine.messages import Done
from vllm_delta.engine.metrics import delta_metrics
from vllm_delta.engine.replicas import rpc_all
from vllm_delta.engine.request import DeltaUpdateRequest, prepare_request
from vllm_delta.engine.transaction import Sync, Transaction
from vllm_delta.weight_transfer.errors import delta_root, parse_error
from vllm_delta.weight_transfer.worker_engine import WORKER_RPC

logger = logging.getLogger("vllm.delta_updates")
router = APIRouter()


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: dict[str, Any]


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: StrictStr | None = None


def enabled(args: Namespace | None) -> bool:
    """`--weight-transfer-config` selects our backend and vLLM mounts its weight routes (dev mode)."""
    from vllm import envs

    config = getattr(args, "weight_transfer_config", None)
    backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    return bool(envs.VLLM_SERVER_DEV_MODE) and is_ours(backend)


def attach(app: FastAPI) -> None:
    app.include_router(router)


def backend_rpc(engine: Any):
    """The core's `Rpc` through the backend's one worker method (`delta_weight_transfer(name, *args)`)."""

    def rpc(name: str, args: tuple):
        return rpc_all(engine, WORKER_RPC, (name, *args))

    return rpc


class WeightTransferDoor:
    """The backend's side of the core: the update prepared between vLLM's `/update_weights` and its finish."""

    def __init__(self, engine: Any) -> None:
        self.core = Transaction(engine, backend_rpc(engine))
        self.prepared: tuple[str, Sync] | None = None  # (request id, its sync) until finished

    def start_probe(self) -> None:
        """At startup, as our route: placement, kernels and the ranks' coverage, before any update."""
        self._probe = self.core.start_probe()

    async def update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Phase 1 on every worker (nothing written); a refusal is the route's status and body.

        Shielded: a client that goes away mid-prepare does not leave vLLM's session open.
        """
        return await asyncio.shield(self._update(update_info))

    async def _update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        async with self.core.lock:
            self.prepared = None
            with weight_operation_metrics().record("update"):
                try:
                    body = _validated(DeltaUpdateRequest, update_info)
                    request = prepare_request(body, delta_root(), None)  # the bound: the workers' init info
                    sync = Sync()
                    await self.core.prepare(request, sync)
                except UpdateError:
                    await self._end_session()
                    raise
            self.prepared = (request.id, sync)
            return {"prepare_s": sync.prepare_s, "tokens_during_prepare": sync.tokens_during_prepare}

    async def finish(self, weight_version: str | None) -> dict[str, Any] | None:
        """Phase 2: commit, holding generation around it when the delta changes anything."""
        async with self.core.lock:
            return await self._finish(weight_version)

    async def _finish(self, weight_version: str | None) -> dict[str, Any] | None:
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        prepared, self.prepared = self.prepared, None

        async def vllm_finish() -> None:  # our engine has nothing left to commit; the session ends
            await _engine_call(self.core.engine.finish_weight_update(weight_version))

        with weight_operation_metrics().record("finish"):
            if prepared is None:
                await vllm_finish()
                return None
            request_id, sync = prepared
            try:
                committed, pause_s = await self.core.commit(request_id, sync, then=vllm_finish)
            except UpdateError:
                await self._end_session()
                raise
        result = self.core.answer(sync, committed, pause_s)
        return {
            k: result[k]
            for k in (
                "version",
                "changed",
                "bytes_read",
                "decode_s",
                "prepare_s",
                "tokens_during_prepare",
                "apply_s",
                "pause_s",
                "trace",
            )
        }

    async def _end_session(self) -> None:
        """Close vLLM's update session after a refusal or a failed commit (nothing stays staged),
        so the client's next `start_weight_update`, e.g. the repairing anchor's, is accepted."""
        with contextlib.suppress(UpdateError):
            await self.core.call("end_session", reply=Done)

    async def status(self) -> dict[str, Any]:
        return await self.core.status()


def _validated(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(exc) from None


async def _engine_call(call) -> None:
    """Await an engine-client call; a worker's error comes back as the route's `UpdateError`."""
    try:
        await call
    except UpdateError:
        raise
    except Exception as exc:
        logger.warning("delta backend: %s", exc)
        raise parse_error(str(exc)) or UpdateError(500, "EngineError", str(exc)) from exc


async def _body(request: Request, model: type[BaseModel], empty_ok: bool = False) -> Any:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or (b"{}" if empty_ok else raw))
    except ValidationError as exc:
        raise bad_request(exc) from None


def _refused(err: UpdateError, what: str) -> JSONResponse:
    logger.warning("delta %s refused (%d): %s", what, err.status, err.error["message"])
    delta_metrics().failed(err.status)
    return err.response()


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    try:
        body = await _body(request, UpdateBody)
        prepared = await request.app.state.delta_weight_transfer.update(body.update_info)
    except UpdateError as err:
        return _refused(err, "update")
    return JSONResponse({"message": "Weights updated", **prepared})


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> JSONResponse:
    try:
        body = await _body(request, FinishBody, empty_ok=True)
        result = await request.app.state.delta_weight_transfer.finish(body.weight_version)
    except UpdateError as err:
        return _refused(err, "commit")
    if result is not None:
        delta_metrics().observe(result)
        logger.info(
            "delta update to version %d (weight_version %s): %d changed, apply %.3fs, paused %.3fs",
            result["version"],
            body.weight_version,
            result["changed"],
            result["apply_s"],
            result["pause_s"],
        )
    return JSONResponse({"message": "Weight update finished", "delta": result})


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    try:
        return JSONResponse(await request.app.state.delta_weight_transfer.status())
    except UpdateError as err:
        return err.response()
