"""Every failure of the delta routes as one JSON body, `{"error": {"type", "message", "file", "param"}}`,
with its HTTP status, whoever refused (a door, a worker, the scatter) and whichever door it came through.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MARKER = "[vllm-delta-error "


class UpdateError(Exception):
    """A failed update: the status to answer and the error body, whoever refused (a worker sends it as
    `reply()`, the door reads it back with `from_worker`); `extra`: where (`file`, `param`) and context."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.error = {"type": type_, "message": message, "file": None, "param": None, **extra}

    @classmethod
    def from_worker(cls, result: dict[str, Any]) -> UpdateError:
        """From a rank's `{"ok": False, "status": ..., "error": {...}}` answer."""
        error = result.get("error") or {}
        status, type_ = int(result.get("status") or 500), str(error.get("type", "EngineError"))
        message = str(error.get("message", "the worker gave no reason"))
        return cls(status, type_, message, file=error.get("file"), param=error.get("param"))

    def reply(self) -> dict[str, Any]:
        """As a worker answers an RPC with it (RPCs never raise: see weight_transfer/worker_engine.py)."""
        return {"ok": False, "status": self.status, "error": self.error}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": self.error})


def validated(model: type[M], data: Any) -> M:
    """`data` (JSON bytes, or already parsed) as `model`; invalid, a 400 naming each invalid field."""
    try:
        return model.model_validate_json(data) if isinstance(data, bytes) else model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise UpdateError(400, "InvalidRequest", problems) from None


class DeltaTransferError(UpdateError):
    """An `UpdateError` whose text carries its status and body: vLLM relays a failed worker call of the
    `delta` backend only as text, which `parse_error` turns back into the answer our route would give."""

    def __str__(self) -> str:
        payload = json.dumps({"status": self.status, "error": self.error})
        return f"{self.error['type']}: {self.error['message']} {MARKER}{payload}]"


def parse_error(text: str) -> UpdateError | None:
    """The `UpdateError` a worker raised, from the text vLLM relayed; None if it is not ours."""
    at = text.find(MARKER)
    if at < 0:
        return None
    try:
        payload, _ = json.JSONDecoder().raw_decode(text, at + len(MARKER))
        return UpdateError.from_worker({"status": payload["status"], "error": payload["error"]})
    except (ValueError, KeyError, TypeError):
        return None
