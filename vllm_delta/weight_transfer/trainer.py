"""The trainer side of the `delta` backend: a `DeltaSender` behind `trainer_init` and `send_weights()`,
over vLLM's weight-sync clients (`SyncClientLinks`); with a `group`, each trainer rank diffs what it holds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from vllm_delta.backend_names import BACKEND
from vllm_delta.client import Reply
from vllm_delta.engine.http_errors import parse_error
from vllm_delta.weight_transfer.registry import register_backends


@dataclass
class DeltaTrainerInitInfo(TrainerInitInfo):
    """`DeltaSender`'s options, plus vLLM's `rank` (0 talks to the engines) and `checkpoint` (seed from the
    served files, not the source); `delta_dir`: the engines' root (disk); `group`: the trainer ranks'."""

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


class DeltaTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaTrainerInitInfo]):
    """One `send_weights()`: one delta sync of the source to every engine; the sender's metrics."""

    init_info_cls = DeltaTrainerInitInfo

    def __init__(
        self, *, client: Any, source: WeightSource, is_sender: bool, sender: Any | None, transport: str
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.transport = transport

    @classmethod
    def trainer_init(
        cls, init_info: DeltaTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> Self:
        """Seed the snapshot; `client`: one `VLLMWeightSyncClient` per engine (or a list of them)."""
        from vllm_delta.sender import DeltaSender

        if source is None:
            raise ValueError("the delta backend diffs the trainer's weights each round: pass source=")
        held = held_names(source)
        if init_info.group is None and held is not None and held != {m.name for m in source.metadata()}:
            why = "this rank holds part of the model (held_names): pass group=, the trainer ranks' gloo group"
            raise ValueError(why + ", so every rank sends what it holds")
        clients, sender = engine_clients(client), None
        if not init_info.is_sender and init_info.group is None:  # rank 0 sends everything
            if init_info.checkpoint is None:
                drain(source)  # rank 0's seeding pass may be a collective (FSDP gathers)
        else:
            if init_info.is_sender and init_info.transport == "disk":
                for c in clients.values():
                    c.init_weight_transfer_engine({"transport": "disk"})
            # Every init info field but these two is the `DeltaSender` option of its name.
            options = {f.name: getattr(init_info, f.name) for f in fields(init_info)}
            options = {k: v for k, v in options.items() if k not in ("rank", "checkpoint")}
            sender = DeltaSender(list(clients), client=SyncClientLinks(clients), **options)
            if init_info.checkpoint is not None:
                sender.seed_from_checkpoint(init_info.checkpoint, names=held)
            else:
                sender.seed(held_tensors(source))
        is_sender, transport = init_info.is_sender, init_info.transport
        return cls(client=client, source=source, is_sender=is_sender, sender=sender, transport=transport)

    def send_weights(self) -> dict[str, float]:
        """Diff, encode, move and apply (prepare, then commit) on every engine; ack-gated."""
        if self.sender is None:
            drain(self.source)
            return {}
        return self.sender.sync(held_tensors(self.source))

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


class SyncClientLinks:
    """The interface `DeltaSender` uses (`update`, `status`, `collective_init`), over vLLM clients."""

    def __init__(self, clients: Mapping[str, Any]) -> None:
        self.clients = dict(clients)

    def update(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        def update(client: Any, body: Mapping[str, Any]) -> dict[str, Any]:
            client.start_weight_update()
            client.update_weights(dict(body))
            client.finish_weight_update(weight_version=str(body["version"]))
            return {"version": body["version"]}

        return self._each(bodies, update)

    def status(self, names: Sequence[str]) -> dict[str, Reply]:
        """The engine's `weight_version` as our version (anything else: unknown, anchor it); the run is
        unknown (None), as vLLM's protocol carries none."""

        def status(client: Any, _: Mapping[str, Any]) -> dict[str, Any]:
            raw = str(engine_info(client, "weight_version", "weight_info"))
            world = int(engine_info(client, "world_size", "get_world_size?include_dp=false"))
            version = int(raw) if raw.isdigit() else -1
            return {"version": version, "run_id": None, "healthy": True, "ranks": list(range(world))}

        return self._each({n: {} for n in names}, status)

    def collective_init(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        def init(client: Any, body: Mapping[str, Any]) -> dict[str, Any]:
            client.init_weight_transfer_engine({"transport": "collective", "collective": dict(body)})
            return {}

        return self._each(bodies, init)

    def _each(self, bodies: Mapping[str, Mapping[str, Any]], call) -> dict[str, Reply]:
        with ThreadPoolExecutor(len(bodies), thread_name_prefix="vllm-delta-weight-transfer") as pool:
            futures = {n: pool.submit(_replied, n, call, self.clients[n], b) for n, b in bodies.items()}
            return {n: f.result() for n, f in futures.items()}


def _replied(name: str, call, client: Any, body: Mapping[str, Any]) -> Reply:
    """A `Reply` as the sender's HTTP client gives one: the engine's status and error body."""
    try:
        return Reply(name, 200, call(client, body))
    except Exception as exc:  # the engine's answer, whatever the client raised it as
        response = getattr(exc, "response", None)
        if response is not None:
            return Reply.of(name, response.status_code, response.text)
        err = parse_error(str(exc))  # an in-process client relays the worker's error as text
        if err is not None:
            return Reply(name, err.status, {"error": err.error})
        return Reply(name, 500, {"error": {"type": type(exc).__name__, "message": str(exc)}})


def engine_info(client: Any, name: str, route: str) -> Any:
    """`get_<name>()` of an `LLM`-like client, else `name` in the answer of vLLM's HTTP `route`."""
    if hasattr(client, f"get_{name}"):
        return getattr(client, f"get_{name}")()
    import requests

    base = getattr(client, "base_url", None)
    if base is None:
        raise TypeError(f"{type(client).__name__} offers neither get_{name} nor a base_url")
    response = requests.get(f"{base}/{route}", timeout=getattr(client, "timeout", 60))
    response.raise_for_status()
    return response.json()[name]


class OfflineLLMClient:
    """vLLM's offline `LLM` as a `VLLMWeightSyncClient` (vLLM ships HTTP and Ray clients only)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __getattr__(self, name: str) -> Any:  # the session calls, `get_weight_version`: the LLM's own
        return getattr(self.llm, name)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def get_world_size(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size


register_backends()  # a trainer process need not load vLLM's plugins: our init info makes `delta` known
