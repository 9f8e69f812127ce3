"""Every failure of the delta routes as one JSON shape with its HTTP status.

Why one place: a client (and the trainer's sender) branches on the status and reads the same
`{"error": {"type", "message", "file", "param"}}` body whether the request was refused by the
route, by a worker while decoding, or by the scatter.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class UpdateError(Exception):
    """A failed update: the status to answer and the error body. Every refusal is one, whoever made it:
    the door, a worker (`reply()` is how a worker sends it, `from_worker` how the door reads it back),
    or the wire format's own errors (`of`). `extra` adds context to the body (`fault`, `refused`)."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        *,
        file: str | None = None,
        param: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = {"type": type_, "message": message, "file": file, "param": param, **extra}

    @classmethod
    def of(cls, status: int, exc: BaseException, **extra: Any) -> UpdateError:
        """`exc` as a refusal: its type, its reason (a `DeltaError`'s) or text, and its file and param."""
        return cls(
            status,
            type(exc).__name__,
            str(getattr(exc, "reason", exc)),
            file=getattr(exc, "file", None),
            param=getattr(exc, "param", None),
            **extra,
        )

    @classmethod
    def from_worker(cls, result: dict[str, Any]) -> UpdateError:
        """From a rank's `{"ok": False, "status": ..., "error": {...}}` answer."""
        error = result.get("error") or {}
        return cls(
            int(result.get("status") or 500),
            str(error.get("type", "EngineError")),
            str(error.get("message", "the worker gave no reason")),
            file=error.get("file"),
            param=error.get("param"),
        )

    def reply(self) -> dict[str, Any]:
        """As a worker answers an RPC with it (RPCs never raise: see weight_transfer/worker_engine.py)."""
        return {"ok": False, "status": self.status, "error": self.error}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": self.error})


def bad_request(exc: ValidationError) -> UpdateError:
    """A 400 naming each invalid field of the request body."""
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
    return UpdateError(400, "InvalidRequest", problems)


def validated(model: type[M], data: Any) -> M:
    """`data` (JSON bytes, or already parsed) as `model`; invalid, a 400 naming each invalid field."""
    try:
        return model.model_validate_json(data) if isinstance(data, bytes) else model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(exc) from None
