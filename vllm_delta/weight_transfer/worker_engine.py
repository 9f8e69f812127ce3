"""The worker half of the `delta` backend: vLLM's `WeightTransferEngine`, over our worker extension.

Why our worker extension underneath: an update through vLLM's API is the same prepare/commit as
through our route, so this engine is a `DeltaWorkerExtension` (same state, lineage, placement and
fault) speaking vLLM's lifecycle. Two callers drive it:

- the HTTP front end, through the core: `collective_rpc` resolves names on vLLM's worker, so
  `install_worker_rpc` gives it one method, `delta_weight_transfer(name, *args)`, reaching the same
  `delta_<name>` methods. These return dicts and never raise: in vLLM 0.32 an RPC raising on
  several ranks reads only the first rank's failure, and the others answer the next RPC.
- the offline `LLM`, whose caller cannot generate meanwhile: it prepares inside `update_weights`,
  the ranks agree over vLLM's CPU world group, and `finish_weight_update` commits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from vllm.distributed.parallel_state import get_world_group
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_delta.engine.cli_args import EPLB_REFUSAL, WORKER_EXTENSION
from vllm_delta.engine.http_errors import UpdateError, validated
from vllm_delta.engine.messages import PrepareReply, PrepareRequest, failure
from vllm_delta.engine.request import CollectiveInitRequest, DeltaUpdateRequest, prepare_request
from vllm_delta.engine.summary import agree
from vllm_delta.engine.worker import DeltaState, DeltaWorkerExtension
from vllm_delta.weight_transfer.errors import DeltaTransferError, delta_root

logger = logging.getLogger(__name__)
# The one method the `delta` backend adds to vLLM's worker class, for the front end's `collective_rpc`.
WORKER_RPC = "delta_weight_transfer"


class DeltaInitInfo(BaseModel):
    """`init_info` of `/init_weight_transfer_engine`: disk needs nothing; collective joins a group."""

    model_config = ConfigDict(extra="forbid")

    transport: Literal["disk", "collective"] = "disk"
    collective: CollectiveInitRequest | None = None
    # The bound on everything one update stages on this engine (413 past it); None: the default.
    max_staged_bytes: int | None = Field(default=None, gt=0)


class DeltaWeightTransferEngine(
    DeltaWorkerExtension, WeightTransferEngine[DeltaInitInfo, DeltaUpdateRequest]
):
    """Registered as `delta` in `WeightTransferEngineFactory`; one per worker (TP/EP rank)."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateRequest
    supports_draft_weight_update = False
    _max_staged_bytes: int | None = None  # from the init info

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        if vllm_config.parallel_config.worker_extension_cls == WORKER_EXTENSION:
            # Each door would keep its own version of the same weights, and refuse the other's lineage.
            raise ValueError(
                "the `delta` weight-transfer backend and --enable-delta-updates (our worker extension) "
                "cannot serve the same engine: choose one"
            )
        if vllm_config.parallel_config.enable_eplb:
            raise ValueError(EPLB_REFUSAL)
        super().__init__(config, vllm_config, device, model)
        self._delta_state: DeltaState | None = None
        self._delta_group = None
        self._max_staged_bytes: int | None = None
        self._staged_id: str | None = None  # what the offline `update_weights` prepared
        self._peers_set = False
        install_worker_rpc()

    # ---- what DeltaWorkerExtension reads from a worker ------------------------------------------
    def _delta_model(self) -> torch.nn.Module:
        return self.model

    def _delta_rank(self) -> int:
        return get_world_group().rank_in_group

    def _delta_max_staged_bytes(self) -> int:
        return self._max_staged_bytes or super()._delta_max_staged_bytes()

    # ---- vLLM's lifecycle -----------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaInitInfo:
        with _raised():
            return validated(DeltaInitInfo, init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaUpdateRequest:
        with _raised():
            return validated(DeltaUpdateRequest, update_dict)

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Learn the placement and compile the kernels (`delta_probe`; done already where the HTTP door
        probed at startup), so the first update pays neither: the offline `LLM` has no door to probe.
        Then disk needs nothing more; collective: this rank joins the trainer's group."""
        self._max_staged_bytes = init_info.max_staged_bytes
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
        # The base class would also synchronize an accelerator; prepare leaves nothing in flight.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaUpdateRequest) -> None:
        """Prepare here, on the engine loop (the offline `LLM`), then agree across ranks."""
        self._drop_staged()
        self._ensure_peers()
        request_id = None
        try:
            request = self._request(update_info)
            request_id = request.id
            result = self.delta_prepare(request)
        except UpdateError as err:  # every rank refuses alike, and all of them still agree below
            result = err.reply()
        self._agree(request_id, result)

    def _request(self, body: DeltaUpdateRequest) -> PrepareRequest:
        """The workers' request, the path resolved under the backend's root exactly as the route does."""
        with _raised():
            return prepare_request(body, delta_root(), self._max_staged_bytes)

    def _agree(self, request_id: str | None, result: dict[str, Any]) -> None:
        """Check the ranks' prepare results and partial digests together, as the core does; if anything
        is refused, every rank drops the update and raises the same error."""
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

    # ---- helpers --------------------------------------------------------------------------------
    def _ensure_peers(self) -> None:
        """Once: every rank learns which elements lower ranks hold, so digests count each once."""
        if not self._peers_set:
            self.delta_set_peers(_all_ranks(self.delta_coverage()))
            self._peers_set = True

    def _drop_staged(self) -> None:
        """Drop whatever an earlier session left: the offline prepare, the front end's (running or staged)."""
        self._staged_id = None
        if self._delta_state is not None:
            self._delta_join_prepare()
            self._delta_state.staged.clear()


@contextlib.contextmanager
def _raised() -> Iterator[None]:
    """A refusal raised for vLLM to relay, its status and body in its text (weight_transfer/errors.py)."""
    try:
        yield
    except UpdateError as err:
        raise DeltaTransferError.of(err) from None


# The worker methods the front end's core reaches (`delta_<name>`), and those that belong inside one of
# vLLM's update sessions (start_weight_update ... finish_weight_update).
CORE_RPCS = frozenset(
    {"probe", "coverage", "set_peers", "prepare_start", "prepare_poll", "commit", "abort", "status"}
)
SESSION_RPCS = frozenset({"prepare_start", "commit"})


def install_worker_rpc() -> None:
    """Give vLLM's worker class `delta_weight_transfer(name, *args)` (`worker_rpc`).

    Why: `collective_rpc` resolves a method name on the worker, not on its weight-transfer engine,
    and vLLM's weight methods cannot poll (`Worker.update_weights` drops the return value and ends
    the session on any exception). Called by `DeltaWeightTransferEngine.__init__`, so only processes
    whose engine uses `delta` get it; idempotent; nothing of vLLM's is replaced.
    """
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, WORKER_RPC):
        setattr(WorkerBase, WORKER_RPC, worker_rpc)


def worker_rpc(worker: Any, name: str, *args: Any) -> dict[str, Any]:
    """`delta_weight_transfer(name, *args)` on vLLM's worker: our engine's `delta_<name>`, or `end_session`.

    Why the session checks here: vLLM's own session methods raise when called out of order, which
    an RPC must not (see the module docstring), so a call outside a session is refused as a 409
    before vLLM could raise. `end_session` is what vLLM 0.32's `Worker.update_weights` does when the
    engine raises (`_weight_update_active = False`, target reset), for a refusal that did not raise.
    """
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, DeltaWeightTransferEngine):
        return UpdateError(
            500, "NotConfigured", f"this worker's weight-transfer engine is not `delta` ({engine!r})"
        ).reply()
    if name in SESSION_RPCS and not worker._weight_update_active:
        return UpdateError(
            409, "NoUpdateSession", "no weight update in progress: call start_weight_update first"
        ).reply()
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
        raise DeltaTransferError.of(UpdateError.from_worker(result))


def _all_ranks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's prepare result (over vLLM's CPU world group), so all ranks decide alike."""
    group = get_world_group()
    if group.world_size == 1:
        return [result]
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, result, group=group.cpu_group)
    return gathered
