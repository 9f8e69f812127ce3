"""The seed's push, `POST /update_weights_from_disk`, as one more path of our route's door.

Why: the seed's trainer (slime's delta sync, and vime's port of it to vLLM) started with
`--update-weight-mode delta --update-weight-transport disk --update-weight-encoding deltas_zstd
--update-weight-delta-dir DIR` writes `DIR/weight_v{N:06d}/rank{R:04d}_flush{K:06d}.safetensors`
and, after each pass of a sync, pushes the files written since the last push:
`{"model_path": "DIR/weight_v000N", "load_format": "delta", "weight_version": "N", "files": [...]}`.
It checks only the HTTP status; the answer has the shape of SGLang's
(`{"success", "message", "num_paused_requests"}`). One sync may push a version in several
parts: the first applies version N over N-1, the later ones re-apply N (the seed's encodings
overwrite, so a version is idempotent; engine/apply.py's lineage check allows that). A sync
that changed nothing pushes no files and calls vLLM's own `/update_weight_version` instead.

This module only translates: the request is our `DeltaUpdateRequest` for the same directory,
files and version, run by the same `DeltaUpdater` (authentication, the root check, the core).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from vllm_delta.engine.http_errors import UpdateError, bad_request
from vllm_delta.engine.metrics import delta_metrics
from vllm_delta.engine.request import DeltaUpdateRequest, read_body

logger = logging.getLogger("vllm.delta_updates")
router = APIRouter()


class SeedPush(BaseModel):
    """The body the seed's trainer posts (slime's `update_weights_from_disk(load_format="delta")`)."""

    model_config = ConfigDict(extra="forbid")

    model_path: StrictStr = Field(min_length=1)
    load_format: Literal["delta"]
    weight_version: StrictStr = Field(pattern=r"^[0-9]{1,18}$")
    files: list[StrictStr] = Field(min_length=1)  # the seed's receiver needs them too

    def as_update(self) -> DeltaUpdateRequest:
        return DeltaUpdateRequest(path=self.model_path, version=int(self.weight_version), files=self.files)


def _answer(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": status == 200, "message": message, "num_paused_requests": 0, **extra}, status_code=status
    )


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    updater = request.app.state.delta_updater
    try:
        updater.authorize(request)
        try:
            push = SeedPush.model_validate_json(await read_body(request, updater.max_body_bytes))
            update = push.as_update()
        except ValidationError as exc:
            raise bad_request(exc) from None
        result = await updater.update(update)
    except UpdateError as err:
        logger.warning("seed push refused (%d): %s", err.status, err.error["message"])
        delta_metrics().failed(err.status)
        return _answer(err.status, f"{err.error['type']}: {err.error['message']}", error=err.error)
    delta_metrics().observe(result)
    logger.info("seed push of version %d: %d changed", result["version"], result["changed"])
    return _answer(200, f"applied version {result['version']}: {result['changed']} changed", delta=result)
