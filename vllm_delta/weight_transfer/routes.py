"""The `delta` backend's door over the core, mounted in dev mode: vLLM's `/update_weights` (the prepare) and
`/finish_weight_update` (the commit, then vLLM's finish), as vLLM's answer every error 500 and never pause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import StrictStr
from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

from vllm_delta.backend_names import is_ours
from vllm_delta.engine.cli_args import dev_mode, weight_transfer_backend
from vllm_delta.engine.http_errors import UpdateError, parse_error, validated
from vllm_delta.engine.messages import Done, Message
from vllm_delta.engine.metrics import answered, observed
from vllm_delta.engine.replicas import rpc_all
from vllm_delta.engine.request import DeltaUpdateRequest, delta_root, prepare_request
from vllm_delta.engine.transaction import Sync, Transaction
from vllm_delta.weight_transfer.worker_engine import WORKER_RPC

logger = logging.getLogger("vllm.delta_updates")
router = APIRouter()


class UpdateBody(Message):
    update_info: dict[str, Any]


class FinishBody(Message):
    weight_version: StrictStr | None = None


def enabled(args: Namespace | None) -> bool:
    """`--weight-transfer-config` selects our backend and vLLM mounts its weight routes (dev mode)."""
    return dev_mode() and is_ours(weight_transfer_backend(args))


class WeightTransferDoor(Transaction):
    """The backend's door over the core, through its one worker RPC method (`delta_weight_transfer`)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, lambda name, args: rpc_all(engine, WORKER_RPC, (name, *args)))
        self.prepared: Sync | None = None  # until finished

    async def update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Phase 1 on every worker (nothing written); a refusal is the route's status and body."""
        async with self.lock:
            self.prepared = None
            with weight_operation_metrics().record("update"):
                try:
                    body = validated(DeltaUpdateRequest, update_info)
                    request = prepare_request(body, delta_root(), None)  # the bound: the workers' init info
                    sync = await self.prepare(request)
                except UpdateError:
                    await self._end_session()
                    raise
            self.prepared = sync
            return {"prepare_s": sync.prepare_s, "tokens_during_prepare": sync.tokens_during_prepare}

    async def finish(self, weight_version: str | None) -> dict[str, Any] | None:
        """Phase 2: commit, holding generation around it when the delta changes anything."""
        async with self.lock:
            prepared, self.prepared = self.prepared, None

            async def vllm_finish() -> None:  # vLLM's session ends; a worker's error comes back as text
                try:
                    await self.engine.finish_weight_update(weight_version)
                except UpdateError:
                    raise
                except Exception as exc:
                    logger.warning("delta backend: %s", exc)
                    raise parse_error(str(exc)) or UpdateError(500, "EngineError", str(exc)) from exc

            with weight_operation_metrics().record("finish"):
                if prepared is None:
                    await vllm_finish()
                    return None
                try:
                    result = await self.commit(prepared, then=vllm_finish)
                except UpdateError:
                    await self._end_session()
                    raise
        return {k: v for k, v in result.items() if k not in ("replay", "fallback", "ranks", "replicas")}

    async def _end_session(self) -> None:
        """Close vLLM's session after a refusal or failed commit, so the next `start_weight_update` works."""
        with contextlib.suppress(UpdateError):
            await self.call("end_session", reply=Done)


def _door(request: Request) -> WeightTransferDoor:
    return request.app.state.delta_weight_transfer


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    async def update() -> dict[str, Any]:
        body = validated(UpdateBody, await request.body())
        # Shielded: a client that goes away mid-prepare does not leave vLLM's session open.
        return {"message": "Weights updated", **await asyncio.shield(_door(request).update(body.update_info))}

    return await answered(update(), "update")


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> JSONResponse:
    async def finish() -> dict[str, Any]:
        body = validated(FinishBody, await request.body() or b"{}")
        result = await _door(request).finish(body.weight_version)
        return {"message": "Weight update finished", "delta": result and observed(result, "commit")}

    return await answered(finish(), "commit")


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    return await answered(_door(request).status())
