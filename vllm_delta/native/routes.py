"""Front end of the `delta` backend: vLLM's own `/update_weights` and `/finish_weight_update`, answered
the way `POST /update_weights_delta` answers.

Why replace these two routes (same paths, same bodies, same engine calls, vLLM's own operation
metrics): vLLM's versions turn every worker error into a 500 and cannot hold generation around a
commit. Ours map the error each worker raised back to the route's status and body, pause
generation (keeping requests, dropping the stale prefix cache) only around the commit of a
non-empty delta, move the `vllm_delta:` series, and keep the version for `/delta_updates/status`
beside vLLM's `weight_version`. They exist only when `--weight-transfer-config` selects `delta`,
in dev mode (where vLLM mounts its routes), and when our endpoint plugin is allowlisted.

`/update_weights` prepares off the engine loop, as the route does: every worker prepares on a
background thread, this front end polls them with cheap RPCs and sleeps between polls, so the
engine keeps generating; then the ranks agree, and `/finish_weight_update` commits, all through
our worker RPC `delta_native` (native/worker_engine.worker_rpc: dicts, never exceptions, which
vLLM 0.32's multiprocess executor would leave unread on every rank but the first). vLLM's own
`finish_weight_update` then closes the session and sets `weight_version`; a refusal or a failed
commit closes it the way vLLM does when its `update_weights` raises (`end_session`). It reports
`prepare_s` and `tokens_during_prepare` (vLLM's `vllm:generation_tokens` counter across the
prepare). One update or commit runs at a time, so no commit writes weights a prepare is reading.

vLLM's weight methods return nothing, so the decode and apply times are measured here around the
RPCs (the slowest rank plus the RPC's own cost), and changed elements and bytes come from the
manifest the workers just verified; health is what this front end saw fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from argparse import Namespace
from time import perf_counter
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from vllm_delta.engine.http_errors import UpdateError, bad_request
from vllm_delta.engine.metrics import delta_metrics
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.native import BACKEND
from vllm_delta.native.errors import delta_root, parse_error, version_dir
from vllm_delta.native.registry import WORKER_RPC

logger = logging.getLogger("vllm.delta_updates")
router = APIRouter()


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: dict[str, Any]


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: StrictStr | None = None


def enabled(args: Namespace | None) -> bool:
    """`--weight-transfer-config` selects `delta` and vLLM mounts its weight routes (dev mode)."""
    from vllm import envs

    config = getattr(args, "weight_transfer_config", None)
    backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    return backend == BACKEND and envs.VLLM_SERVER_DEV_MODE


def attach(app: FastAPI) -> None:
    app.include_router(router)


class NativeUpdater:
    """What the front end knows of native updates: the one being prepared, the committed version."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.version = 0
        self.run_id: str | None = None  # the workers' lineage run (wire.check_lineage's result)
        self.prepared: dict[str, Any] | None = None
        self.dirty: str | None = None
        self.last: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Phase 1 on every worker (nothing written); a refusal is the route's status and body.

        Shielded: a client that goes away mid-prepare does not leave vLLM's session open.
        """
        return await asyncio.shield(self._update(update_info))

    async def _update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        from vllm_delta.engine.routes import generation_tokens

        async with self._lock:
            self.prepared = None
            request_id = uuid.uuid4().hex
            started = perf_counter()
            with weight_operation_metrics().record("update"):
                tokens_before = generation_tokens()
                try:
                    await self._prepare(request_id, update_info)
                    prepare_s, tokens_after = perf_counter() - started, generation_tokens()
                    failed = _first_failed(await self._rpc("agree", request_id))
                except UpdateError:  # an RPC itself failed
                    await self._end_session()
                    raise
                if failed is not None:
                    await self._end_session()
                    raise UpdateError.from_worker(failed)
            body = DeltaUpdateRequest.model_validate(update_info)  # the workers accepted it
            changed, nbytes, lineage = _size(body)
            tokens = None if tokens_before is None or tokens_after is None else tokens_after - tokens_before
            self.prepared = {"version": body.version, "changed": changed, "bytes_read": nbytes,
                             "run_id": lineage.run_id if lineage else None,
                             "decode_s": perf_counter() - started, "prepare_s": prepare_s,
                             "tokens_during_prepare": tokens}
            return {k: self.prepared[k] for k in ("prepare_s", "tokens_during_prepare")}

    async def _prepare(self, request_id: str, update_info: dict[str, Any]) -> None:
        """Start every worker's background prepare and poll until each has ended (well or not)."""
        from vllm_delta.engine.routes import PREPARE_POLL_S

        replies = await self._rpc("prepare_start", request_id, update_info)
        while not all(r["done"] for r in replies):
            await asyncio.sleep(PREPARE_POLL_S)  # hands the engine core back to the scheduler
            replies = await self._rpc("prepare_poll", request_id)

    async def _rpc(self, name: str, *args: Any) -> list[dict[str, Any]]:
        try:
            return await self.engine.collective_rpc(WORKER_RPC, args=(name, *args))
        except Exception as exc:
            logger.exception("delta backend: %s failed on a worker", name)
            raise UpdateError(500, "EngineError", f"{name} failed on a worker: {exc}") from exc

    async def _end_session(self) -> None:
        """Close vLLM's update session after a refusal or a failed commit (nothing stays staged),
        so the client's next `start_weight_update`, e.g. the repairing anchor's, is accepted."""
        with contextlib.suppress(UpdateError):
            await self._rpc("end_session")

    async def finish(self, weight_version: str | None) -> dict[str, Any] | None:
        """Phase 2: commit, holding generation around it when the delta changes anything.

        As on the route, a commit that fails part-way leaves generation paused (partly written
        weights are never served) until a later commit succeeds, which only an anchor can then.
        """
        async with self._lock:
            return await self._finish(weight_version)

    async def _finish(self, weight_version: str | None) -> dict[str, Any] | None:
        from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

        prepared, self.prepared = self.prepared, None
        pause = bool(prepared and prepared["changed"] > 0)
        started = perf_counter()
        if pause and self.dirty is None:
            try:
                await self.engine.pause_generation(mode="keep", clear_cache=True)
            except Exception as exc:
                raise UpdateError(500, "EngineError", f"could not pause generation: {exc}") from exc
        with weight_operation_metrics().record("finish"):
            committed = perf_counter()
            try:
                failed = _first_failed(await self._rpc("commit"))
            except UpdateError as err:
                failed = {"ok": False, "status": err.status, "error": err.error}
            apply_s = perf_counter() - committed
            if failed is None:  # vLLM's finish: our engine has nothing left to commit; the session ends
                await _engine_call(self.engine.finish_weight_update(weight_version))
        if failed is not None:
            err = UpdateError.from_worker(failed)
            if pause and err.status >= 500:
                self.dirty = f"version {prepared['version']}: {err.error['message']}"
                logger.error("delta backend: commit failed; generation stays paused: %s", self.dirty)
            elif pause and self.dirty is None:
                await self.engine.resume_generation()
            await self._end_session()
            raise err
        if pause:
            self.dirty = None
            await self.engine.resume_generation()
        if prepared is None:
            return None
        self.version, self.run_id = prepared["version"], prepared.pop("run_id")
        self.last = {**prepared, "apply_s": apply_s, "pause_s": perf_counter() - started if pause else 0.0}
        return self.last

    async def status(self) -> dict[str, Any]:
        return {"version": self.version, "run_id": self.run_id,
                "weight_version": await self.engine.get_weight_version(),
                "healthy": self.dirty is None, "dirty_reasons": [self.dirty] if self.dirty else [],
                "last": self.last}


def _first_failed(replies: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in replies if not r.get("ok")), None)


def _size(body: DeltaUpdateRequest) -> tuple[int, int, Any]:
    """Changed elements and delta bytes, from the manifest the workers just verified."""
    from vllm_delta.wire import load_manifest, parse_manifest

    if body.transport == "collective":
        manifest = parse_manifest(json.dumps(body.manifest).encode())
    else:
        manifest = load_manifest(version_dir(body.path, delta_root()))
    return manifest.changed, manifest.total_bytes, manifest.lineage


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
        prepared = await request.app.state.delta_native.update(body.update_info)
    except UpdateError as err:
        return _refused(err, "update")
    return JSONResponse({"message": "Weights updated", **prepared})


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> JSONResponse:
    try:
        body = await _body(request, FinishBody, empty_ok=True)
        result = await request.app.state.delta_native.finish(body.weight_version)
    except UpdateError as err:
        return _refused(err, "commit")
    if result is not None:
        delta_metrics().observe(result)
        logger.info("delta update to version %d (weight_version %s): %d changed, apply %.3fs, paused %.3fs",
                    result["version"], body.weight_version, result["changed"], result["apply_s"], result["pause_s"])
    return JSONResponse({"message": "Weight update finished", "delta": result})


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    return JSONResponse(await request.app.state.delta_native.status())
