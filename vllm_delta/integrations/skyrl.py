"""SkyRL 0.4's weight sync through vllm-delta: `generator.inference_engine.weight_sync_backend=vllm_delta`.
SkyRL's one client fans out to every server; our sender gates its snapshot on each engine's answer, so it
is seen as one view per server. SkyRL's backend list is closed (an unknown name becomes `nccl`), so
`register()` adds `vllm_delta`; call it in every SkyRL process, e.g. from a module the run imports first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vllm_delta.backend_names import BACKEND as RECEIVE_BACKEND
from vllm_delta.weight_transfer.trainer import DeltaTrainerInitInfo, DeltaTrainerWeightTransferEngine

SKYRL_NAME = "vllm_delta"  # the value of SkyRL's `weight_sync_backend`
TRAINER_BACKEND = "vllm_delta_skyrl"  # our trainer engine for SkyRL's client, in vLLM's trainer registry


class SkyrlServer(HTTPVLLMWeightSyncClient):
    """One server of a `SkyrlWeightSyncClient`: vLLM's weight-sync calls over SkyRL's HTTP session."""

    def __init__(self, client: Any, url: str) -> None:
        super().__init__(url)
        self.client = client

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        response = self.client._session.post(f"{self.base_url}/{path}", json=json, timeout=None)
        response.raise_for_status()  # the answer's status and body reach the sender (trainer._replied)


@dataclass
class SkyrlDeltaInitInfo(DeltaTrainerInitInfo):
    backend: ClassVar[str] = TRAINER_BACKEND


class SkyrlDeltaTrainerEngine(DeltaTrainerWeightTransferEngine):
    """Our trainer engine over SkyRL's client; declares what SkyRL's worker reads off every engine."""

    init_info_cls = SkyrlDeltaInitInfo
    skyrl_handles_prefix_cache_reset = False  # SkyRL's worker resets it after the send
    skyrl_force_disable_expandable_segments = False
    skyrl_empty_cache_after_send = False  # nothing of ours lives on the device
    skyrl_draft_source = None

    @classmethod
    def trainer_init(cls, init_info: DeltaTrainerInitInfo, *, client: Any, source: Any = None):
        servers = [SkyrlServer(client, url) for url in client._urls] if hasattr(client, "_urls") else client
        return super().trainer_init(init_info, client=servers, source=source)


def register_trainer_engine() -> None:
    """Our trainer engine for SkyRL's client, in vLLM's trainer registry (idempotent)."""
    if TRAINER_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(TRAINER_BACKEND, SkyrlDeltaTrainerEngine)


def register() -> None:
    """Teach SkyRL the name `vllm_delta` (idempotent): its strategy, the servers' receive backend,
    and the trainer's init info, from SkyRL's own config (`delta_weight_sync.sync_dir` is the
    engines' `--delta-updates-root`; the policy checkpoint seeds the snapshot)."""
    import skyrl.backends.skyrl_train.weight_sync as sync
    from skyrl.backends.skyrl_train.weight_sync import weight_senders

    register_trainer_engine()
    if getattr(sync.get_transfer_strategy, "vllm_delta", False):
        return
    strategy, build = sync.get_transfer_strategy, weight_senders._build_sender_init_info

    def get_transfer_strategy(weight_sync_backend: str, colocate_all: bool) -> str:
        return (
            SKYRL_NAME if weight_sync_backend == SKYRL_NAME else strategy(weight_sync_backend, colocate_all)
        )

    def build_sender_init_info(*, backend: str, ie_cfg: Any, rank: int, base_model_path: Any, **kwargs: Any):
        if backend != SKYRL_NAME:
            return build(backend=backend, ie_cfg=ie_cfg, rank=rank, base_model_path=base_model_path, **kwargs)
        sync_cfg = getattr(ie_cfg, "delta_weight_sync", None)
        if sync_cfg is None or not sync_cfg.sync_dir:
            raise ValueError("vllm_delta needs generator.inference_engine.delta_weight_sync.sync_dir")
        return SkyrlDeltaInitInfo(delta_dir=sync_cfg.sync_dir, checkpoint=base_model_path, rank=rank), None

    get_transfer_strategy.vllm_delta = True  # type: ignore[attr-defined]
    sync.get_transfer_strategy = get_transfer_strategy
    sync._VLLM_RECEIVE_BACKENDS[SKYRL_NAME] = RECEIVE_BACKEND
    weight_senders._build_sender_init_info = build_sender_init_info
