"""The `delta` backend's worker half: the HTTP door drives it through the core and `worker_rpc`; the offline
`LLM` prepares in `update_weights`, agrees over vLLM's CPU world group, and commits at the finish."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field
from vllm.distributed.parallel_state import get_world_group
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_delta.engine.cli_args import EPLB_REFUSAL, TWO_DOORS_REFUSAL, WORKER_EXTENSION
from vllm_delta.engine.http_errors import DeltaTransferError, UpdateError, validated
from vllm_delta.engine.messages import Message, PrepareReply, failure
from vllm_delta.engine.replicas import agree
from vllm_delta.engine.request import CollectiveInitRequest, DeltaUpdateRequest, delta_root, prepare_request
from vllm_delta.engine.worker import DeltaState, DeltaWorkerExtension

logger = logging.getLogger(__name__)
# The one method the `delta` backend adds to vLLM's worker class, for the front end's `collective_rpc`.
WORKER_RPC = "delta_weight_transfer"


class DeltaInitInfo(Message):
    """`init_info` of `/init_weight_transfer_engine`: disk needs nothing; collective joins a group;
    `max_staged_bytes` bounds everything one update stages here (413 past it; None: the default)."""

    transport: Literal["disk", "collective"] = "disk"
    collective: CollectiveInitRequest | None = None
    max_staged_bytes: int | None = Field(default=None, gt=0)


class DeltaWeightTransferEngine(
    DeltaWorkerExtension, WeightTransferEngine[DeltaInitInfo, DeltaUpdateRequest]
):
    """Registered as `delta` in `WeightTransferEngineFactory`; one per worker (TP/EP rank)."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateRequest
    supports_draft_weight_update = False
    _delta_state: DeltaState | None = None
    _staged_id: str | None = None  # what the offline `update_weights` prepared
    _peers_set = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        if vllm_config.parallel_config.worker_extension_cls == WORKER_EXTENSION:
            raise ValueError(TWO_DOORS_REFUSAL)
        if vllm_config.parallel_config.enable_eplb:
            raise ValueError(EPLB_REFUSAL)
        super().__init__(config, vllm_config, device, model)
        install_worker_rpc()

    def _delta_model(self) -> torch.nn.Module:
        return self.model

    def _delta_rank(self) -> int:
        return get_world_group().rank_in_group

    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaInitInfo:
        with _raised():
            return validated(DeltaInitInfo, init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaUpdateRequest:
        with _raised():
            return validated(DeltaUpdateRequest, update_dict)

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Probe and compile now (the offline `LLM` has no door to do it at startup); join a collective."""
        self._delta_max_staged = init_info.max_staged_bytes
        self.delta_probe()
        if init_info.transport == "disk":
            return
        if init_info.collective is None:
            raise DeltaTransferError(400, "InvalidRequest", "a collective init needs `collective`")
        with _raised():
            init_info.collective.check_ranks(get_world_group().world_size)
        _raise_failed(self.delta_collective_init(init_info.collective.model_dump()))

    def start_weight_update(self) -> None:
        self._drop_staged()  # an earlier session that never finished

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # nothing in flight to synchronize

    def receive_weights(self, update_info: DeltaUpdateRequest) -> None:
        """Prepare here, on the engine loop (the offline `LLM`), then agree across ranks as the core does:
        if any rank refused, every rank drops the update and raises the same error."""
        self._drop_staged()
        if not self._peers_set:  # once: which elements lower ranks hold, so digests count each once
            self.delta_set_peers(_all_ranks(self.delta_coverage()))
            self._peers_set = True
        request_id = None
        try:  # the path resolved under the backend's root exactly as the route does
            request = prepare_request(update_info, delta_root(), self._delta_max_staged)
            request_id = request.id
            result = self.delta_prepare(request)
        except UpdateError as err:  # every rank refuses alike, and all of them still agree below
            result = err.reply()
        with _raised():
            try:
                agree([PrepareReply.model_validate(r) for r in _all_ranks(result)])
            except UpdateError:
                if self._delta_state is not None and request_id is not None:  # else refused before any state
                    self.delta_abort(request_id)
                raise
        self._staged_id = request_id

    def finish_weight_update(self) -> None:
        """Commit what `update_weights` prepared (nothing if it prepared nothing)."""
        if self._staged_id is None:
            return
        request_id, self._staged_id = self._staged_id, None
        _raise_failed(self.delta_commit(request_id))

    def shutdown(self) -> None:
        self._drop_staged()
        self._delta_group = None

    def _drop_staged(self) -> None:
        """Drop whatever an earlier session left: the offline prepare, the front end's (running or staged)."""
        self._staged_id = None
        if self._delta_state is not None:
            self._delta_join_prepare()
            self._delta_state.staged.clear()


@contextlib.contextmanager
def _raised() -> Iterator[None]:
    """A refusal raised for vLLM to relay, its status and body in its text (engine/http_errors.py)."""
    try:
        yield
    except UpdateError as err:
        raise DeltaTransferError.from_worker(err.reply()) from None


# The worker methods the core reaches (`delta_<name>`), and those that belong inside a vLLM update session.
CORE_RPCS = frozenset("probe coverage set_peers prepare_start prepare_poll commit abort status".split())
SESSION_RPCS = frozenset({"prepare_start", "commit"})


def install_worker_rpc() -> None:
    """Give vLLM's worker class `worker_rpc`, idempotently: `collective_rpc` resolves names on the worker,
    not its weight-transfer engine, and vLLM's weight methods cannot poll (`update_weights` returns None)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, WORKER_RPC):
        setattr(WorkerBase, WORKER_RPC, worker_rpc)


def worker_rpc(worker: Any, name: str, *args: Any) -> dict[str, Any]:
    """Our engine's `delta_<name>`, or `end_session` (vLLM's cleanup when the engine raises). Never raises:
    vLLM 0.32 reads one rank's failure and the others answer the next RPC; outside a session it is a 409."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, DeltaWeightTransferEngine):
        why = f"this worker's weight-transfer engine is not `delta` ({engine!r})"
        return UpdateError(500, "NotConfigured", why).reply()
    if name in SESSION_RPCS and not worker._weight_update_active:
        why = "no weight update in progress: call start_weight_update first"
        return UpdateError(409, "NoUpdateSession", why).reply()
    try:
        if name == "end_session":
            engine._drop_staged()
            worker._weight_update_active = False
            engine.reset_weight_update_target()
            return {"ok": True}
        if name not in CORE_RPCS:
            return UpdateError(400, "UnknownMethod", f"no backend RPC {name!r}").reply()
        return getattr(engine, f"delta_{name}")(*args)
    except Exception as exc:  # input errors come back as dicts already; anything else is ours
        logger.exception("delta backend: %s failed", name)
        return failure(500, exc)


def _raise_failed(result: dict[str, Any]) -> None:
    if not result.get("ok"):
        raise DeltaTransferError.from_worker(result)


def _all_ranks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's prepare result (over vLLM's CPU world group), so all ranks decide alike."""
    group = get_world_group()
    if group.world_size == 1:
        return [result]
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, result, group=group.cpu_group)
    return gathered
