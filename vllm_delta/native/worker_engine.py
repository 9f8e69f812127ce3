"""The worker side of the `delta` backend: vLLM's `WeightTransferEngine` over our two-phase apply.

Why these phases: `update_weights` only prepares (reads, verifies, decodes and locates the delta on
every rank, no weight touched), and `finish_weight_update` commits (scatters), so bad input fails
before anything changes and the scatter is the only work done while generation is held. The
methods are `DeltaWorkerExtension`'s own (`delta_prepare`, `delta_commit`, ...): the same code
serves `POST /update_weights_delta`. Ranks agree before any commits: one refusal aborts all.

Why prepare off the engine loop: vLLM runs `update_weights` inside the engine core's busy loop, so
a prepare there stops generation for the whole read and decode. Our HTTP front end (native/routes)
does not call vLLM's `update_weights` at all: through the one RPC method `delta_native` that
`registry.install_worker_rpc` gives vLLM's worker (`worker_rpc` below) it starts the prepare on a
background thread (`native_prepare_start`), polls `native_prepare_poll` between engine steps, has
the ranks agree (`native_agree`) and commits (`native_commit`); vLLM's `finish_weight_update`
then only closes the session and sets `weight_version`. These RPCs return dicts and never raise:
in vLLM 0.32 an RPC that raises on several ranks reads only the first rank's failure, so the
other ranks' replies answer the next RPC (at TP >= 2 every later call is off by one). The offline
`LLM` (`OfflineLLMClient`), whose caller cannot generate meanwhile, still prepares inside
`update_weights` and commits in `finish_weight_update`, raising on a refusal, as before.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_delta.engine.cli_args import DEFAULT_CHUNK_BYTES, EPLB_REFUSAL, WORKER_EXTENSION
from vllm_delta.engine.http_errors import UpdateError, bad_request
from vllm_delta.engine.request import CollectiveInitRequest, DeltaUpdateRequest
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.worker import DeltaState, DeltaWorkerExtension
from vllm_delta.wire import DeltaError
from vllm_delta.native.errors import DeltaTransferError, delta_root, version_dir
from vllm_delta.native.registry import install_worker_rpc

logger = logging.getLogger(__name__)


class DeltaInitInfo(BaseModel):
    """`init_info` of `/init_weight_transfer_engine`: disk needs nothing; collective joins a group."""

    model_config = ConfigDict(extra="forbid")

    transport: Literal["disk", "collective"] = "disk"
    collective: CollectiveInitRequest | None = None


class DeltaWeightTransferEngine(DeltaWorkerExtension, WeightTransferEngine[DeltaInitInfo, DeltaUpdateRequest]):
    """Registered as `delta` in `WeightTransferEngineFactory`; one per worker (TP/EP rank)."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateRequest
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        if vllm_config.parallel_config.worker_extension_cls == WORKER_EXTENSION:
            # Each door would keep its own version of the same weights, and refuse the other's lineage.
            raise ValueError("the `delta` weight-transfer backend and --enable-delta-updates (our worker extension) "
                             "cannot serve the same engine: choose one")
        if vllm_config.parallel_config.enable_eplb:
            raise ValueError(EPLB_REFUSAL)
        super().__init__(config, vllm_config, device, model)
        self._delta_state: DeltaState | None = None
        self._delta_group = None
        self._staged_id: str | None = None
        self._peers_set = False
        # The background prepare the front end started: (request id, its reply once done).
        self._native: tuple[str, dict[str, Any] | None] | None = None
        install_worker_rpc()

    # ---- what DeltaWorkerExtension reads from a worker ------------------------------------------
    def _delta_model(self) -> torch.nn.Module:
        return self.model

    def _delta_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group

    # ---- vLLM's lifecycle -----------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaInitInfo:
        return _validated(DeltaInitInfo, init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaUpdateRequest:
        return _validated(DeltaUpdateRequest, update_dict)

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Disk: nothing to set up. Collective: this rank joins the trainer's group."""
        if init_info.transport == "disk":
            return
        if init_info.collective is None:
            raise DeltaTransferError(400, "InvalidRequest", "a collective init needs `collective`")
        config = init_info.collective
        ranks = _world_size()
        if config.world_size != config.rank_offset + ranks:
            raise DeltaTransferError(400, "InvalidRequest", f"world_size {config.world_size} != rank_offset "
                                     f"{config.rank_offset} + {ranks} engine ranks")
        _raise_failed(self.delta_collective_init(config.model_dump()))

    def start_weight_update(self) -> None:
        self._abort_staged()  # an earlier session that never finished
        self._drop_native()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would also synchronize an accelerator; prepare leaves nothing in flight.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaUpdateRequest) -> None:
        """Prepare here, on the engine loop (the offline `LLM`), then agree across ranks."""
        self._abort_staged()
        self._drop_native()
        self._ensure_peers()
        request_id = uuid.uuid4().hex
        try:
            result = self.delta_prepare(self._request(request_id, update_info))
        except UpdateError as err:
            result = {"ok": False, "status": err.status, "error": err.error}
        self._agree(request_id, result)

    # ---- the HTTP front end's RPCs (through `worker_rpc`); each returns a dict, never raises ----
    def native_prepare_start(self, request_id: str, update_info: dict[str, Any]) -> dict[str, Any]:
        """Validate and start `delta_prepare` on a background thread; returns at once.

        The one-time cross-rank coverage exchange runs here, on the worker's main thread: the
        background thread must never use the groups the forward pass uses.
        """
        self._abort_staged()
        self._drop_native()
        self._native = (request_id, None)
        try:
            body = self.parse_update_info(update_info)
            self._ensure_peers()
            started = self.delta_prepare_start(self._request(request_id, body))
        except UpdateError as err:
            started = {"ok": False, "status": err.status, "error": err.error}
        if not started.get("ok"):
            self._native = (request_id, started)
        return _brief(started, done=not started.get("ok"))

    def native_prepare_poll(self, request_id: str) -> dict[str, Any]:
        """`done` once this rank's prepare ended (the reply stays here for `native_agree`); cheap."""
        if self._native is None or self._native[0] != request_id:
            return _brief(_failure(409, "KeyError", f"no background prepare {request_id!r} on this rank"), done=True)
        reply = self._native[1]
        if reply is None:
            reply = self.delta_prepare_poll(request_id)
            if reply.get("ok") and not reply.get("done", True):
                return _brief(reply, done=False)
            self._native = (request_id, reply)
        return _brief(reply, done=True)

    def native_agree(self, request_id: str) -> dict[str, Any]:
        """Every rank's prepare of `request_id`, checked together; staged for `native_commit` if all
        agree, else dropped on every rank with the same refusal. Every rank must call it."""
        native, self._native = self._native, None
        if native is not None and native[0] == request_id and native[1] is not None:
            result = native[1]
        else:
            self._native = native
            self._drop_native()  # a prepare still running, or another one: joined and dropped
            result = _failure(409, "KeyError", f"no finished background prepare {request_id!r} on this rank")
        try:
            self._agree(request_id, result)
        except UpdateError as err:
            return {"ok": False, "status": err.status, "error": err.error}
        return {"ok": True, "rank": self._delta_rank()}

    def native_commit(self) -> dict[str, Any]:
        """Scatter what `native_agree` staged (`ok` with nothing to do if nothing is staged)."""
        if self._staged_id is None:
            return {"ok": True, "rank": self._delta_rank(), "committed": False}
        request_id, self._staged_id = self._staged_id, None
        return {**self.delta_commit(request_id), "committed": True}

    def _drop_native(self) -> None:
        """Join a background prepare nobody will use and drop what it staged."""
        native, self._native = self._native, None
        if native is not None and self._delta_state is not None:
            self.delta_abort(native[0])

    def _agree(self, request_id: str, result: dict[str, Any]) -> None:
        """Check the ranks' prepare results and partial digests together, as the route does; if
        anything is refused, every rank drops the update and raises the same error."""
        results = _all_ranks(result)
        failed = next((r for r in results if not r.get("ok")), None)
        if failed is None:
            try:
                check_partials(results)
            except DeltaError as exc:
                failed = {"ok": False, "status": exc.http_status,
                          "error": {"type": type(exc).__name__, "message": exc.reason, "param": exc.param}}
        if failed is not None:
            if self._delta_state is not None:  # None: refused before this rank held any state
                self.delta_abort(request_id)
            _raise_failed(failed)
        self._staged_id = request_id

    def finish_weight_update(self) -> None:
        """Commit what `update_weights` prepared (nothing if it prepared nothing)."""
        if self._staged_id is None:
            return
        request_id, self._staged_id = self._staged_id, None
        _raise_failed(self.delta_commit(request_id))

    def shutdown(self) -> None:
        self._abort_staged()
        self._drop_native()
        self._delta_group = None

    # ---- helpers --------------------------------------------------------------------------------
    def _request(self, request_id: str, body: DeltaUpdateRequest) -> dict[str, Any]:
        """The route's worker request, the path resolved under the root exactly as the route does."""
        request = {"id": request_id, "version": body.version, "base_version": body.base_version,
                   "chunk_bytes": DEFAULT_CHUNK_BYTES}
        if body.transport == "collective":
            request.update(transport="collective", manifest=body.manifest)
        else:
            root = delta_root()
            request.update(path=str(version_dir(body.path, root)), root=str(root), files=body.files)
        return request

    def _ensure_peers(self) -> None:
        """Once: every rank learns which elements lower ranks hold, so digests count each once."""
        if not self._peers_set:
            self.delta_set_peers(_all_ranks(self.delta_coverage()))
            self._peers_set = True

    def _abort_staged(self) -> None:
        if self._staged_id is not None:
            self.delta_abort(self._staged_id)
            self._staged_id = None


def _validated(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = bad_request(exc)
        raise DeltaTransferError(err.status, err.error["type"], err.error["message"]) from None


# Front-end RPCs that belong inside one of vLLM's update sessions (start_weight_update ... finish).
SESSION_RPCS = ("prepare_start", "agree", "commit", "end_session")


def worker_rpc(worker: Any, name: str, *args: Any) -> dict[str, Any]:
    """`delta_native(name, *args)` on vLLM's worker: our engine's `native_<name>`, or `end_session`.

    Why the session checks here: vLLM's own session methods raise when called out of order, which
    an RPC must not (see the module docstring), so a call outside a session is refused as a 409
    before vLLM could raise. `end_session` is what vLLM 0.32's `Worker.update_weights` does when the
    engine raises (`_weight_update_active = False`, target reset), for a refusal that did not raise.
    """
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, DeltaWeightTransferEngine):
        return _failure(500, "NotConfigured", f"this worker's weight-transfer engine is not `delta` ({engine!r})")
    if name in SESSION_RPCS and not worker._weight_update_active:
        return _brief(_failure(409, "NoUpdateSession", "no weight update in progress: call start_weight_update "
                               "first"), done=True)
    try:
        if name == "end_session":
            engine._abort_staged()
            engine._drop_native()
            worker._weight_update_active = False
            engine.reset_weight_update_target()
            return {"ok": True}
        return getattr(engine, f"native_{name}")(*args)
    except Exception as exc:  # input errors come back as dicts already; anything else is ours
        logger.exception("delta backend: %s failed", name)
        return _brief(_failure(500, type(exc).__name__, str(exc)), done=True)


def _failure(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": {"type": kind, "message": message, "file": None, "param": None}}


def _brief(reply: dict[str, Any], done: bool) -> dict[str, Any]:
    """What the front end needs of a rank's prepare reply (its digests stay on the worker)."""
    keys = ("ok", "status", "error", "rank", "prepare_s", "decode_s")
    return {**{k: reply[k] for k in keys if k in reply}, "done": done}


def _raise_failed(result: dict[str, Any]) -> None:
    if not result.get("ok"):
        err = UpdateError.from_worker(result)
        raise DeltaTransferError(err.status, err.error["type"], err.error["message"], file=err.error["file"],
                                 param=err.error["param"])


def _world_size() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().world_size


def _all_ranks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's prepare result (over vLLM's CPU world group), so all ranks decide alike."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [result]
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, result, group=group.cpu_group)
    return gathered
