"""The worker side of the `delta` backend: vLLM's `WeightTransferEngine` over our two-phase apply.

Why these phases: `update_weights` only prepares (reads, verifies, decodes and locates the delta on
every rank, no weight touched), and `finish_weight_update` commits (scatters), so bad input fails
before anything changes and the scatter is the only work done while generation is held. The
methods are `DeltaWorkerExtension`'s own (`delta_prepare`, `delta_commit`, ...): the same code
serves `POST /update_weights_delta`. Ranks agree before any commits: one refusal aborts all.
"""

from __future__ import annotations

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

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would also synchronize an accelerator; prepare leaves nothing in flight.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaUpdateRequest) -> None:
        """Prepare on every rank, then check the ranks' partial digests together, as the route does;
        if anything is refused, every rank drops the update and raises the same error."""
        self._abort_staged()
        self._ensure_peers()
        request_id = uuid.uuid4().hex
        try:
            result = self.delta_prepare(self._request(request_id, update_info))
        except UpdateError as err:
            result = {"ok": False, "status": err.status, "error": err.error}
        results = _all_ranks(result)
        failed = next((r for r in results if not r.get("ok")), None)
        if failed is None:
            try:
                check_partials(results)
            except DeltaError as exc:
                failed = {"ok": False, "status": exc.http_status,
                          "error": {"type": type(exc).__name__, "message": exc.reason, "param": exc.param}}
        if failed is not None:
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
