"""`DeltaWorkerExtension`: the worker methods the HTTP route reaches through `collective_rpc`.

Why a worker extension: it is vLLM's own way (`--worker-extension-cls`) to add RPC methods to
every TP/EP worker, so each rank decodes and writes only the entries it owns. Methods return
plain dicts (never raise) so one rank's bad input reaches the route as a status code.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from vllm_delta.engine.apply import ApplyFault, DeltaApplier, StagedUpdate
from vllm_delta.engine.cli_args import DEFAULT_CHUNK_BYTES
from vllm_delta.wire import DeltaError, parse_manifest
from vllm_delta.wire.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


@dataclass
class DeltaState:
    """Per-worker lineage and health. `dirty` means a scatter failed part-way."""

    applier: DeltaApplier
    version: int = 0
    dirty_reason: str | None = None
    last: dict[str, Any] | None = None
    staged: dict[str, tuple[StagedUpdate, int]] = field(default_factory=dict)


def _error(status: int, exc: BaseException, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": {
        "type": type(exc).__name__, "message": str(getattr(exc, "reason", exc)),
        "file": getattr(exc, "file", None), "param": getattr(exc, "param", None), **extra}}


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _delta(self) -> DeltaState:
        state = getattr(self, "_delta_state", None)
        if state is None:
            model = self.model_runner.get_model()
            checkpoint = Checkpoint.open(self.vllm_config.model_config.model).meta
            state = DeltaState(DeltaApplier(model, checkpoint))
            self._delta_state = state
        return state

    def _delta_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def delta_prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        """Phase 1: read, verify, decode and locate; no weight changes."""
        state = self._delta()
        flushes = None
        if request.get("transport") == "collective":
            # Receive every flush before any check, so the trainer's broadcast never blocks on a refusal.
            try:
                flushes = self._delta_receive()
            except Exception as exc:
                return _error(500, exc)
        if state.dirty_reason:
            return _error(500, RuntimeError(f"engine is dirty: {state.dirty_reason}"))
        try:
            if flushes is not None:
                manifest = parse_manifest(json.dumps(request["manifest"]).encode())
                staged = state.applier.prepare_flushes(
                    manifest, zip([f.name for f in manifest.files], flushes), version=int(request["version"]),
                    base_version=request.get("base_version"), current_version=state.version)
            else:
                staged = state.applier.prepare(
                    request["path"], version=int(request["version"]), base_version=request.get("base_version"),
                    current_version=state.version, files=request.get("files"))
        except DeltaError as exc:
            return _error(exc.http_status, exc)
        except (OSError, ValueError) as exc:
            return _error(400, exc)
        state.staged = {request["id"]: (staged, int(request.get("chunk_bytes") or DEFAULT_CHUNK_BYTES))}
        return {"ok": True, "rank": self._delta_rank(), "changed": staged.changed,
                "total_changed": staged.total_changed, "bytes_read": staged.bytes_read,
                "decode_s": staged.decode_s, "fallback": staged.fallback_names, "replay": staged.replay}

    def delta_commit(self, request_id: str) -> dict[str, Any]:
        """Phase 2: scatter what `delta_prepare` staged. A failure here marks the engine dirty."""
        state = self._delta()
        if request_id not in state.staged:
            return _error(409, KeyError(f"no prepared update {request_id!r}"))
        staged, chunk_bytes = state.staged.pop(request_id)
        try:
            apply_s = state.applier.commit(staged, chunk_bytes)
        except ApplyFault as exc:
            state.dirty_reason = f"version {staged.version}: {exc}"
            logger.error("delta updates: %s\n%s", state.dirty_reason, traceback.format_exc())
            return _error(500, exc)
        state.version = staged.version
        state.last = {"version": staged.version, "changed": staged.changed, "bytes_read": staged.bytes_read,
                      "decode_s": staged.decode_s, "apply_s": apply_s, "replay": staged.replay,
                      "time": time.time()}
        return {"ok": True, "rank": self._delta_rank(), "apply_s": apply_s, "version": state.version}

    def delta_collective_init(self, config: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's process group (rank 0 is the trainer) for collective deltas."""
        from vllm_delta.transports.collective import make_group

        try:
            self._delta_group = make_group(
                backend=config["backend"], master_addr=config["master_addr"],
                master_port=int(config["master_port"]), rank=int(config["rank_offset"]) + self._delta_rank(),
                world_size=int(config["world_size"]), timeout_s=float(config.get("timeout_s") or 120.0))
        except Exception as exc:
            self._delta_group = None
            return _error(500, exc)
        return {"ok": True, "rank": self._delta_rank(), "group_rank": self._delta_group.rank}

    def _delta_receive(self) -> list[bytes]:
        from vllm_delta.transports.collective import recv_flushes
        from vllm_delta.wire import Limits

        group = getattr(self, "_delta_group", None)
        if group is None:
            raise RuntimeError("no collective group: POST /delta_updates/collective/init first")
        try:
            return recv_flushes(group, Limits().max_decoded_bytes)
        except Exception:
            self._delta_group = None  # a failed collective leaves the group unusable
            raise

    def delta_abort(self, request_id: str) -> None:
        self._delta().staged.pop(request_id, None)

    def delta_status(self) -> dict[str, Any]:
        state = self._delta()
        return {"rank": self._delta_rank(), "version": state.version, "dirty": state.dirty_reason is not None,
                "dirty_reason": state.dirty_reason, "last": state.last,
                "fallback": state.applier.fallback_tensors if state.applier.probed else None}
