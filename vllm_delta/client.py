"""HTTP client for the engine's delta routes (aiohttp): one concurrent request per engine, called from sync
code (inside a running event loop, as in Ray async actors, on a private loop in a thread).

Retries only where the request cannot have reached the update logic (no connection, 502/503/504); any
other answer, a 500 included (a possibly dirty engine), is final and goes back to the sender.
"""

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
    ) -> None:
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
        self.retries, self.backoff_s = retries, backoff_s

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"Content-Type": "application/json", **auth}

    async def _request(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        route: str,
        body: Mapping[str, Any] | None,
    ) -> Reply:
        last = Reply(url, 0, {"error": {"type": "NotSent", "message": "no attempt made"}})
        for attempt in range(1, self.retries + 2):
            try:
                data = None if body is None else json.dumps(body).encode()
                async with session.request(
                    method, url.rstrip("/") + route, data=data, headers=self.headers()
                ) as resp:
                    try:
                        payload = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        payload = {"error": {"type": "HTTPError", "message": (await resp.text())[:500]}}
                    payload = payload if isinstance(payload, dict) else {"body": payload}
                    last = Reply(url, resp.status, payload)
                    if resp.status not in RETRY_STATUSES:
                        return last
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                error = {"type": type(exc).__name__, "message": str(exc) or repr(exc)}
                last = Reply(url, 0, {"error": error})
                if isinstance(exc, asyncio.TimeoutError):
                    return last  # the engine may still be applying: do not send it twice
            await asyncio.sleep(self.backoff_s * attempt)
        return last

    def _many(
        self, method: str, route: str, bodies: Mapping[str, Mapping[str, Any] | None]
    ) -> dict[str, Reply]:
        """Every request at once, from sync code, whether or not this thread runs an event loop."""

        async def gather() -> list[Reply]:
            async with aiohttp.ClientSession(timeout=self.timeout) as session:
                return await asyncio.gather(
                    *(self._request(session, method, u, route, b) for u, b in bodies.items())
                )

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
