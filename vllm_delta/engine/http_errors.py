"""Every failure of the delta routes as one JSON shape with its HTTP status.

Why one place: a client (and the trainer's sender) branches on the status and reads the same
`{"error": {"type", "message", "file", "param"}}` body whether the request was refused by the
route, by a worker while decoding, or by the scatter.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class UpdateError(Exception):
    """A failed update: the status to answer and the error body, as a worker reports it."""

    def __init__(self, status: int, type_: str, message: str, *, file: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error = {"type": type_, "message": message, "file": file, "param": param}

    @classmethod
    def from_worker(cls, result: dict[str, Any]) -> "UpdateError":
        """From a rank's `{"ok": False, "status": ..., "error": {...}}` answer."""
        error = result.get("error") or {}
        return cls(int(result.get("status", 500)), str(error.get("type", "EngineError")),
                   str(error.get("message", "the worker gave no reason")),
                   file=error.get("file"), param=error.get("param"))

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": self.error})


def bad_request(exc: ValidationError) -> UpdateError:
    """A 400 naming each invalid field of the request body."""
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
    return UpdateError(400, "InvalidRequest", problems)
