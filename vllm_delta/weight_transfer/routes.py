"""Front end of the `delta` backend, one door over the transaction core: vLLM's own `/update_weights` and
`/finish_weight_update`, answered the way `POST /update_weights_delta` answers.

Why replace vLLM's two routes (same paths and bodies): vLLM's turn every worker error into a 500
and cannot hold generation around a commit. Here `/update_weights` is the core's prepare (while the
engine generates) and `/finish_weight_update` its commit, after which vLLM's own
`finish_weight_update` closes the session and sets `weight_version`; a refusal or failed commit
ends the session as vLLM does when its `update_weights` raises. Mounted only when
`--weight-transfer-config` selects `delta`, in dev mode (where vLLM mounts its routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr

from vllm_delta.backend_names import is_ours
from vllm_delta.engine.cli_args import dev_mode, weight_transfer_backend
from vllm_delta.engine.http_errors import UpdateError, validated
from vllm_delta.engine.messages import Done
from vllm_delta.engine.metrics import observed, refused
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
    return dev_mode() and is_ours(weight_transfer_backend(args))


class WeightTransferDoor(Transaction):
    """The backend's door over the core: the update prepared between vLLM's `/update_weights` and its
    finish, reaching the workers through the backend's one RPC method (`delta_weight_transfer`)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, lambda name, args: rpc_all(engine, WORKER_RPC, (name, *args)))
        self.prepared: tuple[str, Sync] | None = None  # (request id, its sync) until finished

    async def update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Phase 1 on every worker (nothing written); a refusal is the route's status and body.

        Shielded: a client that goes away mid-prepare does not leave vLLM's session open.
        """
        return await asyncio.shield(self._update(update_info))

    async def _update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        async with self.lock:
            self.prepared = None
            with weight_operation_metrics().record("update"):
                try:
                    body = validated(DeltaUpdateRequest, update_info)
                    request = prepare_request(body, delta_root(), None)  # the bound: the workers' init info
                    sync = Sync()
                    await self.prepare(request, sync)
                except UpdateError:
                    await self._end_session()
                    raise
            self.prepared = (request.id, sync)
            return {"prepare_s": sync.prepare_s, "tokens_during_prepare": sync.tokens_during_prepare}

    async def finish(self, weight_version: str | None) -> dict[str, Any] | None:
        """Phase 2: commit, holding generation around it when the delta changes anything."""
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        async with self.lock:
            prepared, self.prepared = self.prepared, None

            async def vllm_finish() -> None:  # our engine has nothing left to commit; the session ends
                await _engine_call(self.engine.finish_weight_update(weight_version))

            with weight_operation_metrics().record("finish"):
                if prepared is None:
                    await vllm_finish()
                    return None
                request_id, sync = prepared
                try:
                    committed, pause_s = await self.commit(request_id, sync, then=vllm_finish)
                except UpdateError:
                    await self._end_session()
                    raise
            result = self.answer(sync, committed, pause_s)
        return {k: v for k, v in result.items() if k not in ("replay", "fallback", "ranks", "replicas")}

    async def _end_session(self) -> None:
        """Close vLLM's update session after a refusal or a failed commit (nothing stays staged),
        so the client's next `start_weight_update`, e.g. the repairing anchor's, is accepted."""
        with contextlib.suppress(UpdateError):
            await self.call("end_session", reply=Done)


async def _engine_call(call) -> None:
    """Await an engine-client call; a worker's error comes back as the route's `UpdateError`."""
    try:
        await call
    except UpdateError:
        raise
    except Exception as exc:
        logger.warning("delta backend: %s", exc)
        raise parse_error(str(exc)) or UpdateError(500, "EngineError", str(exc)) from exc


async def _answer(request: Request, action, what: str = "") -> JSONResponse:
    """`action` on the door and the request's body; a refusal's answer (logged and counted as `what`'s)."""
    try:
        return JSONResponse(await action(request.app.state.delta_weight_transfer, await request.body()))
    except UpdateError as err:
        return (refused(err, what) if what else err).response()


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    async def update(door: WeightTransferDoor, raw: bytes) -> dict[str, Any]:
        return {"message": "Weights updated", **await door.update(validated(UpdateBody, raw).update_info)}

    return await _answer(request, update, "update")


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> JSONResponse:
    async def finish(door: WeightTransferDoor, raw: bytes) -> dict[str, Any]:
        result = await door.finish(validated(FinishBody, raw or b"{}").weight_version)
        return {"message": "Weight update finished", "delta": result and observed(result, "commit")}

    return await _answer(request, finish, "commit")


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    return await _answer(request, lambda door, _: door.status())
