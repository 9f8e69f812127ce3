"""verl's `CheckpointEngine` for vllm-delta, loaded by verl's `custom_backend_module` (docs/integrations.md).
The actor's rank 0 is a `DeltaSender` pushing to each engine's `POST /update_weights_delta`, so the rollout
side receives nothing; other actor ranks only drain their generator (verl's gathers are collectives)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from vllm_delta.sender import DeltaSender

BACKEND = "vllm_delta"
logger = logging.getLogger(__name__)


@CheckpointEngineRegistry.register(BACKEND)
class VllmDeltaCheckpointEngine(CheckpointEngine):
    """`engines`: the vLLM servers' base URLs; `delta_dir`: their `--delta-updates-root`, shared;
    `checkpoint`: the checkpoint they loaded (seeds the snapshot exactly; without it the first
    `send_weights` seeds it and sends nothing, so the actor's weights must then equal the served ones).
    Further keyword arguments go to `DeltaSender` (`api_key`, `encoding`, `anchor_every`, ...)."""

    def __init__(
        self,
        bucket_size: int,
        engines: Iterable[str] = (),
        delta_dir: str | None = None,
        checkpoint: str | None = None,
        **sender_options: Any,
    ) -> None:
        self.bucket_size = bucket_size
        self.engines, self.delta_dir, self.checkpoint = list(engines), delta_dir, checkpoint
        self.sender_options = sender_options
        self.rank: int | None = None
        self.sender: DeltaSender | None = None

    def prepare(self) -> dict[str, Any]:
        return {}  # no transport of verl's to set up: the engines are reached over HTTP

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Only the actor ranks take part: rank 0 sends."""
        return {"rank": list(range(actor_wg_world_size))}, {"rank": [None] * rollout_world_size}

    def init_process_group(self, rank: int | None = None, **kwargs: Any) -> None:
        self.rank = rank

    def finalize(self) -> None:
        """Kept across steps: the sender's snapshot is what the next step diffs against."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """One delta sync of `weights` to every engine (rank 0); the sender's metrics, which verl logs."""
        named = [(name, t) async for name, t in _kept(ensure_async_iterator(weights), self.rank == 0)]
        if self.rank != 0:
            return {}
        if self.sender is None:
            if not self.engines or self.delta_dir is None:
                raise ValueError(
                    "the vllm_delta checkpoint engine needs engine_kwargs `engines` and `delta_dir`"
                )
            self.sender = DeltaSender(self.engines, "disk", self.delta_dir, **self.sender_options)
            if self.checkpoint is None:
                self.sender.seed(named)
                return {}
            self.sender.seed_from_checkpoint(self.checkpoint)
        try:
            return self.sender.sync(named)
        except Exception as exc:  # the sync never stops training: `sender.status()` keeps the error
            logger.error("vllm-delta: weight sync failed (training goes on): %s: %s", type(exc).__name__, exc)
            return {"sender/publish_failed": 1.0}

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Nothing: the engines applied the delta when the actor pushed it."""
        return
        yield


async def _kept(
    weights: AsyncIterator[tuple[str, torch.Tensor]], keep: bool
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """The tensors, copied to the CPU when kept: a gather's tensors are re-partitioned once it moves on."""
    async for name, t in weights:
        if keep:
            yield name, t.detach().to("cpu", copy=True)
