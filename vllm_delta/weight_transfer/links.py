"""`DeltaSender`'s engine client, spoken through vLLM's `VLLMWeightSyncClient`s.

Why: the sender plans, encodes and gates its snapshot on acks per engine; all it needs from an
engine is "apply this version" and "which version do you hold". Over vLLM's four-method protocol
that is `start_weight_update`, `update_weights` (the version directory or the manifest) and
`finish_weight_update(weight_version=str(version))`, and the held version is vLLM's own
`weight_version`. Each client is one engine (for several engines, pass several clients); they are
driven concurrently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_delta.client import Reply
from vllm_delta.weight_transfer.errors import parse_error


class SyncClientLinks:
    """The interface `DeltaSender` uses (`update`, `status`, `collective_init`), over vLLM clients."""

    def __init__(self, clients: Mapping[str, Any]) -> None:
        self.clients = dict(clients)

    def update(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        return self._each(bodies, self._update)

    def status(self, names: Sequence[str]) -> dict[str, Reply]:
        return self._each({n: {} for n in names}, self._status)

    def collective_init(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        return self._each(bodies, self._collective_init)

    def _each(self, bodies: Mapping[str, Mapping[str, Any]], call) -> dict[str, Reply]:
        if len(bodies) == 1:
            name, body = next(iter(bodies.items()))
            return {name: _replied(name, call, self.clients[name], body)}
        with ThreadPoolExecutor(
            max_workers=len(bodies), thread_name_prefix="vllm-delta-weight-transfer"
        ) as pool:
            futures = {n: pool.submit(_replied, n, call, self.clients[n], b) for n, b in bodies.items()}
            return {n: f.result() for n, f in futures.items()}

    @staticmethod
    def _update(client: Any, body: Mapping[str, Any]) -> dict[str, Any]:
        client.start_weight_update()
        client.update_weights(dict(body))
        client.finish_weight_update(weight_version=str(body["version"]))
        return {"version": body["version"]}

    @staticmethod
    def _status(client: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        """The engine's `weight_version` as our version; any other value means "unknown: anchor it".

        vLLM's protocol carries no run id, so the run is reported as unknown (None): a new sender
        takes an engine at version 0 as the checkpoint and anchors one past it, as it cannot vouch
        for whose weights those are.
        """
        raw = weight_version(client)
        version = int(raw) if raw.isdigit() else -1
        return {"version": version, "run_id": None, "healthy": True, "ranks": list(range(world_size(client)))}

    @staticmethod
    def _collective_init(client: Any, body: Mapping[str, Any]) -> dict[str, Any]:
        client.init_weight_transfer_engine({"transport": "collective", "collective": dict(body)})
        return {}


def _replied(name: str, call, client: Any, body: Mapping[str, Any]) -> Reply:
    """A `Reply` as the sender's HTTP client gives one: the engine's status and error body."""
    try:
        return Reply(name, 200, call(client, body))
    except Exception as exc:  # the engine's answer, whatever the client raised it as
        response = getattr(exc, "response", None)
        if response is not None:
            try:
                payload = response.json()
            except ValueError:
                payload = {"error": {"type": "HTTPError", "message": response.text[:500]}}
            return Reply(
                name, response.status_code, payload if isinstance(payload, dict) else {"body": payload}
            )
        err = parse_error(str(exc))  # an in-process client relays the worker's error as text
        if err is not None:
            return Reply(name, err.status, {"error": err.error})
        return Reply(name, 500, {"error": {"type": type(exc).__name__, "message": str(exc)}})


def weight_version(client: Any) -> str:
    """vLLM's `weight_version` through the client: an `LLM`-like one, or vLLM's HTTP route."""
    if hasattr(client, "get_weight_version"):
        return str(client.get_weight_version())
    return str(_get(client, "weight_info")["weight_version"])


def world_size(client: Any) -> int:
    """The engine's worker count (TP x PP), each of which joins a collective group."""
    if hasattr(client, "get_world_size"):
        return int(client.get_world_size())
    return int(_get(client, "get_world_size?include_dp=false")["world_size"])


def _get(client: Any, route: str) -> dict[str, Any]:
    import requests

    base = getattr(client, "base_url", None)
    if base is None:
        raise TypeError(f"{type(client).__name__} offers neither get_weight_version nor a base_url")
    response = requests.get(f"{base}/{route}", timeout=getattr(client, "timeout", 60))
    response.raise_for_status()
    return response.json()


class OfflineLLMClient:
    """vLLM's offline `LLM` as a `VLLMWeightSyncClient` (vLLM ships HTTP and Ray clients only).

    Its `update_weights` prepares inside vLLM's RPC, on the engine loop (the HTTP door prepares on
    a background thread instead): the caller of an offline `LLM` drives the engine, so nothing
    generates while it waits for an update anyway.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def get_world_size(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
