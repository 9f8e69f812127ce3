"""The trainer side of the `delta` backend: `WeightTransferTrainerFactory.trainer_init(...)` ->
`send_weights()`.

Why a `DeltaSender` underneath: the snapshot, the ack gating (the snapshot advances only when every
engine holds the new version), overwrite catch-ups for a lagging engine and anchors are all there;
this class only adapts its inputs (a `WeightSource`) and its outputs (vLLM's weight-sync clients,
through `SyncClientLinks`). Every trainer rank calls `trainer_init` and `send_weights`; with a
`group`, each rank diffs what it holds (`held_names`: PP stages, EP experts) and rank 0 talks to
the engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from vllm_delta.backend_names import BACKEND
from vllm_delta.weight_transfer.links import SyncClientLinks
from vllm_delta.weight_transfer.registry import register_backends


@dataclass
class DeltaTrainerInitInfo(TrainerInitInfo):
    """`DeltaSender`'s options, plus vLLM's keyword-only `rank` (0 talks to the engines).

    `delta_dir` (disk transport) is the directory every engine serves as `--delta-updates-root`.
    `checkpoint` seeds the snapshot from the engines' own checkpoint files; without it, from the
    source's weights at `trainer_init`, which must then equal what the engines serve. `group`: a
    torch.distributed (gloo) group of all trainer ranks, for sources split across ranks.
    `signing_keys`: the first signs every manifest, for engines started with
    `--delta-updates-signing-key` (None: from the environment, as `DeltaSender` reads it).
    """

    backend: ClassVar[str] = BACKEND

    delta_dir: str | None = None
    encoding: str = "ulp_zstd"
    transport: str = "disk"
    checkpoint: str | None = None
    overwrite_encoding: str = "planes_zstd"
    flush_bytes: int = 512 << 20
    anchor_every: int | None = None
    keep: bool = False
    post_hash: bool = False
    master_addr: str = "127.0.0.1"
    collective_timeout_s: float = 120.0
    version: int = 0
    group: Any = None
    signing_keys: list[str] | None = None

    def __post_init__(self) -> None:
        if self.transport == "disk" and self.delta_dir is None:
            raise ValueError("the disk transport needs delta_dir (the engines' --delta-updates-root)")


# The init info's fields that are `DeltaSender`'s options of the same name.
SENDER_OPTIONS = (
    *("transport", "delta_dir", "encoding", "overwrite_encoding", "flush_bytes", "anchor_every", "keep"),
    *("post_hash", "master_addr", "collective_timeout_s", "group", "version", "signing_keys"),
)


class DeltaTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaTrainerInitInfo]):
    """One `send_weights()` = one delta sync of the source to every engine; returns the sender's metrics."""

    init_info_cls = DeltaTrainerInitInfo

    def __init__(
        self, *, client: Any, source: WeightSource, is_sender: bool, sender: Any | None, transport: str
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.transport = transport
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def trainer_init(
        cls, init_info: DeltaTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> Self:
        """Check every engine runs the `delta` backend, then seed the snapshot.

        `client` is one `VLLMWeightSyncClient` per engine: one, or a list for several engines.
        """
        from vllm_delta.sender import DeltaSender

        if source is None:
            raise ValueError("the delta backend diffs the trainer's weights each round: pass source=")
        held = held_names(source)
        if init_info.group is None and held is not None and held != {m.name for m in source.metadata()}:
            raise ValueError(
                "this rank holds part of the model (held_names): pass group=, the trainer ranks' "
                "gloo group, so every rank sends what it holds"
            )
        clients = engine_clients(client)
        if not init_info.is_sender and init_info.group is None:  # rank 0 sends everything
            if init_info.checkpoint is None:
                drain(source)  # rank 0's seeding pass may be a collective (FSDP gathers)
            return cls(
                client=client, source=source, is_sender=False, sender=None, transport=init_info.transport
            )
        if init_info.is_sender and init_info.transport == "disk":
            for c in clients.values():
                c.init_weight_transfer_engine({"transport": "disk"})
        options = {k: getattr(init_info, k) for k in SENDER_OPTIONS}
        sender = DeltaSender(list(clients), client=SyncClientLinks(clients), **options)
        if init_info.checkpoint is not None:
            sender.seed_from_checkpoint(init_info.checkpoint, names=held)
        else:
            sender.seed(held_tensors(source))
        return cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            sender=sender,
            transport=init_info.transport,
        )

    def send_weights(self) -> dict[str, float]:
        """Diff, encode, move and apply (prepare, then commit) on every engine; ack-gated."""
        if self.sender is None:
            drain(self.source)
            return {}
        self.last_metrics = self.sender.sync(held_tensors(self.source))
        return self.last_metrics

    def shutdown(self) -> None:
        """Stop the sender (its collective groups too) and release the engines' ends of them."""
        if self.sender is None:
            return
        self.sender.close()
        if self.is_sender and self.transport != "disk":
            for c in engine_clients(self.client).values():
                c.shutdown_weight_transfer_engine()


def engine_clients(client: Any) -> dict[str, Any]:
    """Name -> client, one per engine: its base URL where it has one, else its position."""
    clients = list(client) if isinstance(client, Sequence) else [client]
    named = {getattr(c, "base_url", None) or f"engine-{i}": c for i, c in enumerate(clients)}
    if len(named) != len(clients):
        raise ValueError("two clients for the same engine URL")
    return named


def held_names(source: WeightSource) -> set[str] | None:
    held = source.held_names()
    return None if held is None else set(held)


def drain(source: WeightSource) -> None:
    for _ in source:
        pass


def held_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """One fresh pass over the source: the tensors this rank holds (PP/EP sources yield None for others)."""
    held = held_names(source)
    for name, tensor in source:
        if tensor is not None and (held is None or name in held):
            yield name, tensor.detach()


register_backends()  # a trainer process need not load vLLM's plugins: our init info makes `delta` known
