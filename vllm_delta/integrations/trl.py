"""TRL's `VLLMClient` syncing through `DeltaSender`: `GRPOTrainer(use_vllm=True, vllm_mode="server")`
ships deltas after one call, `use_delta(delta_dir)`, made before the trainer. Why a subclass: TRL's server
mode syncs with `update_named_params` over an NCCL group that needs CUDA; everything else stays TRL's.
The first sync sends an anchor, so the engine may start from any checkpoint."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from trl.generation import vllm_generation
from trl.generation.vllm_client import VLLMClient

from vllm_delta.backend_names import ALIAS, BACKEND

logger = logging.getLogger(__name__)


def use_delta(delta_dir: str | None = None, **options: Any) -> None:
    """Every `VLLMClient` TRL builds from now on syncs through `DeltaSender(delta_dir=..., **options)`
    (`options`: `DeltaSender`'s, and `copy`, see `DeltaVLLMClient`)."""
    vllm_generation.VLLMClient = functools.partial(DeltaVLLMClient, delta_dir=delta_dir, **options)


class DeltaVLLMClient(VLLMClient):
    """`VLLMClient` whose `init_communicator` opens a `DeltaSender` and whose `update_named_params`
    sends one delta. `copy`: keep copies of the tensors TRL yields (True: they are gathered and
    freed behind us, ZeRO-3/FSDP), pass them as they are (False), or ask accelerate (None)."""

    def __init__(
        self, *args: Any, delta_dir: str | None = None, copy: bool | None = None, **options: Any
    ) -> None:
        sender_options = {k: options.pop(k) for k in list(options) if k not in _CLIENT_ARGS}
        key = sender_options.get("api_key")
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}  # for a server run with --api-key
        super().__init__(*args, **options)
        self.delta_dir, self.copy, self.sender_options = delta_dir, copy, sender_options
        self.sender: Any = None
        self.kept: dict[str, torch.Tensor] = {}
        self.seeded = False
        self.last_metrics: dict[str, float] = {}
        self.failures = 0
        self.last_error: str | None = None

    def _get(self, url: str, **kwargs: Any) -> dict:
        self.session.headers.update(self.auth)  # VLLMClient.__init__ made the session; this is its first use
        return super()._get(url, **kwargs)

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Open the sender on the server's door; refuse a server that runs another backend."""
        from vllm_delta.sender import DeltaSender

        backend = (self.get_server_info().get("weight_transfer_config") or {}).get("backend")
        client = None  # our route: DeltaSender's own HTTP client
        if backend in (BACKEND, ALIAS):
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            from vllm_delta.weight_transfer.trainer import SyncClientLinks

            engine = HTTPVLLMWeightSyncClient(self.base_url)
            if self.sender_options.get("transport", "disk") == "disk":
                engine.init_weight_transfer_engine({"transport": "disk"})
            client = SyncClientLinks({self.base_url: engine})
        elif backend is not None:
            raise RuntimeError(
                f"the vLLM server at {self.base_url} runs the weight-transfer backend {backend!r}: start it "
                f"""with --weight-transfer-config '{{"backend": "{BACKEND}"}}' --delta-updates-root DIR, """
                "or with --enable-delta-updates --delta-updates-root DIR"
            )
        self.sender = DeltaSender(
            [self.base_url], delta_dir=self.delta_dir, client=client, **self.sender_options
        )

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """One delta of the whole model (the first sync: all of it). Never raises a failed sync."""
        if self.sender is None:
            raise RuntimeError("init_communicator() first")
        error: BaseException | None = None
        try:
            named = take(named_params, self.kept, sharded() if self.copy is None else self.copy)
            if not self.seeded:
                self.sender.seed(named)
                self.sender.request_anchor()  # the engine may hold anything: send it everything once
                self.seeded = True
            self.sender.capture(named)
            self.sender.publish()
            self.last_metrics = self.sender.wait()
            if self.last_metrics.get("sender/publish_failed"):
                error = self.sender.last_error
        except Exception as exc:  # the sync never stops training
            self.last_metrics, error = {"sender/publish_failed": 1.0}, exc
            for _ in named_params:  # the other ranks' gathers are collectives: walk the rest with them
                pass
            logger.error("vllm-delta: weight sync failed (training goes on): %s: %s", type(exc).__name__, exc)
        if error is not None:
            self.failures += 1
            self.last_error = f"{type(error).__name__}: {error}"

    def status(self) -> dict[str, Any]:
        """The sender's state (failed publishes, each engine's) and this client's failed syncs."""
        sender = self.sender.status() if self.sender else {}
        return {**sender, "failed_syncs": self.failures, "last_sync_error": self.last_error}

    def close_communicator(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def take(
    named_params: Iterable[tuple[str, torch.Tensor]], kept: dict[str, torch.Tensor], copy: bool
) -> list[tuple[str, torch.Tensor]]:
    """The tensors to diff, read before the iterator undoes a gather: with `copy`, into `kept`'s buffers."""
    out = []
    with torch.no_grad():
        for name, tensor in named_params:
            if not copy:
                out.append((name, tensor.detach()))
                continue
            buf, like = kept.get(name), (tensor.shape, tensor.dtype, tensor.device)
            if buf is None or (buf.shape, buf.dtype, buf.device) != like:
                buf = kept[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            buf.copy_(tensor)
            out.append((name, buf))
    return out


_CLIENT_ARGS = ("base_url", "host", "server_port", "group_port", "connection_timeout")


def sharded() -> bool:
    """Whether accelerate shards the model (ZeRO-3 or FSDP), so each yielded tensor is a gather."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if not AcceleratorState._shared_state:  # no accelerator in this process: nothing gathers
        return False
    state = AcceleratorState()
    if state.distributed_type == DistributedType.FSDP:
        return True
    plugin = getattr(state, "deepspeed_plugin", None)
    return state.distributed_type == DistributedType.DEEPSPEED and getattr(plugin, "zero_stage", 0) == 3
