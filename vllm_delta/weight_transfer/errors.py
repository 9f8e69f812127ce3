"""Errors of the `delta` backend, and the root its deltas must live under.

Why a marker in the text: a worker's exception reaches vLLM's front end only as text (vLLM relays
the message of a failed RPC), so each error carries its HTTP status and the route's error body,
and our front end turns it back into the answer `POST /update_weights_delta` would give.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_delta import settings
from vllm_delta.engine.http_errors import UpdateError

MARKER = "[vllm-delta-error "


class DeltaTransferError(UpdateError):
    """An `UpdateError` whose text carries its status and body across vLLM's RPC layers."""

    @classmethod
    def of(cls, err: UpdateError) -> DeltaTransferError:
        e = err.error
        return cls(err.status, e["type"], e["message"], file=e["file"], param=e["param"])

    def __str__(self) -> str:
        return f"{self.error['type']}: {self.error['message']} {error_text(self.status, self.error)}"


def error_text(status: int, error: dict[str, Any]) -> str:
    return MARKER + json.dumps({"status": status, "error": error}) + "]"


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


def delta_root() -> Path:
    """The configured root, resolved (containment compares real paths)."""
    value = settings.updates_root()
    if not value:
        raise DeltaTransferError(
            500,
            "NotConfigured",
            f"the delta backend needs a root: --delta-updates-root or {settings.UPDATES_ROOT}",
        )
    return Path(os.path.realpath(value))
