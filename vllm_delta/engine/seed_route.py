"""The seed's push, `POST /update_weights_from_disk`, as one more path of our route's door.

Why: the seed's trainer (slime's delta sync, vime's vLLM port) writes
`DIR/weight_v{N:06d}/rank{R:04d}_flush{K:06d}.safetensors` and pushes each pass's files as
`{"model_path", "load_format": "delta", "weight_version", "files"}`, reading only the HTTP status of
an SGLang-shaped answer. A version may come in several parts; the seed's encodings overwrite, so a
re-applied version is idempotent (the lineage check allows it). This module only translates it
into our `DeltaUpdateRequest`, run by the same `DeltaUpdater`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from vllm_delta.engine.http_errors import UpdateError, validated
from vllm_delta.engine.metrics import observed, refused
from vllm_delta.engine.request import DeltaUpdateRequest, read_body

router = APIRouter()


class SeedPush(BaseModel):
    """The body the seed's trainer posts (slime's `update_weights_from_disk(load_format="delta")`)."""

    model_config = ConfigDict(extra="forbid")

    model_path: StrictStr = Field(min_length=1)
    load_format: Literal["delta"]
    weight_version: StrictStr = Field(pattern=r"^[0-9]{1,18}$")
    files: list[StrictStr] = Field(min_length=1)  # the seed's receiver needs them too

    def as_update(self) -> DeltaUpdateRequest:
        """Our request for the same directory, files and version (a bad file name: a 400, as ours)."""
        body = {"path": self.model_path, "version": int(self.weight_version), "files": self.files}
        return validated(DeltaUpdateRequest, body)


def _answer(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": status == 200, "message": message, "num_paused_requests": 0, **extra}, status_code=status
    )


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    updater = request.app.state.delta_updater
    try:
        updater.authorize(request)
        push = validated(SeedPush, await read_body(request, updater.max_body_bytes))
        result = observed(await updater.update(push.as_update()), "seed push")
    except UpdateError as err:
        refused(err, "seed push")
        return _answer(err.status, f"{err.error['type']}: {err.error['message']}", error=err.error)
    return _answer(200, f"applied version {result['version']}: {result['changed']} changed", delta=result)
