"""HTTP client for the engines' delta routes (aiohttp), one concurrent request each, from sync code. Retries
only a request that cannot have reached the update (no connection, 502/503/504); a 500 is final."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

UPDATE_ROUTE = "/update_weights_delta"
STATUS_ROUTE = "/delta_updates/status"
COLLECTIVE_INIT_ROUTE = "/delta_updates/collective/init"
RETRY_STATUSES = frozenset({502, 503, 504})


@dataclass
class Reply:
    """One engine's answer: `ok` with the JSON body, or the error (HTTP status 0 = no answer)."""

    url: str
    status: int
    body: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, url: str, status: int, text: str) -> Reply:
        """From an HTTP answer: its JSON object as the body, or its text as the error."""
        try:
            payload = json.loads(text)
        except ValueError:
            payload = {"error": {"type": "HTTPError", "message": text[:500]}}
        return cls(url, status, payload if isinstance(payload, dict) else {"body": payload})

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error(self) -> dict[str, Any] | None:
        if self.ok:
            return None
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else {"type": "HTTPError", "message": str(self.body)}


class EngineClient:
    """Talks to a set of engines, concurrently."""

    def __init__(
        self,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:  # backoff_s: seconds times the attempt number, between retries
        self.api_key, self.retries, self.backoff_s = api_key, retries, backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)

    def _many(
        self, method: str, route: str, bodies: Mapping[str, Mapping[str, Any] | None]
    ) -> dict[str, Reply]:
        """Every request at once, from sync code, whether or not this thread runs an event loop."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers = {"Content-Type": "application/json", **auth}

        async def one(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any] | None) -> Reply:
            last = Reply(url, 0, {"error": {"type": "NotSent", "message": "no attempt made"}})
            data = None if body is None else json.dumps(body).encode()
            for attempt in range(1, self.retries + 2):
                try:
                    async with session.request(method, url.rstrip("/") + route, data=data) as resp:
                        last = Reply.of(url, resp.status, await resp.text())
                        if resp.status not in RETRY_STATUSES:
                            return last
                except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                    error = {"type": type(exc).__name__, "message": str(exc) or repr(exc)}
                    last = Reply(url, 0, {"error": error})
                    if isinstance(exc, asyncio.TimeoutError):
                        return last  # the engine may still be applying: do not send it twice
                await asyncio.sleep(self.backoff_s * attempt)
            return last

        async def gather() -> list[Reply]:
            async with aiohttp.ClientSession(timeout=self.timeout, headers=headers) as session:
                return await asyncio.gather(*(one(session, u, b) for u, b in bodies.items()))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return dict(zip(bodies, asyncio.run(gather())))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-client") as pool:
            return dict(zip(bodies, pool.submit(asyncio.run, gather()).result()))

    def update(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        """`POST /update_weights_delta` to each engine (url -> body)."""
        return self._many("POST", UPDATE_ROUTE, bodies)

    def status(self, urls: Sequence[str]) -> dict[str, Reply]:
        return self._many("GET", STATUS_ROUTE, {u: None for u in urls})

    def collective_init(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        return self._many("POST", COLLECTIVE_INIT_ROUTE, bodies)
