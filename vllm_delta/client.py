"""HTTP client for the engine's delta routes (aiohttp): one concurrent request per engine.

Why retries only on some errors: a connection error or a 502/503/504 means the request did not
reach the engine's update logic, so sending it again is safe. Any other answer (4xx, or a 500 from
the engine, which may mean a half-applied, dirty engine) is final and goes back to the sender,
which decides what the engine needs next.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
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
    attempts: int = 1

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
    """Talks to a set of engines; every call is synchronous for the caller and concurrent inside."""

    def __init__(self, api_key: str | None = None, *, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 retries: int = 3, backoff_s: float = 0.5) -> None:
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    async def _request(self, session: aiohttp.ClientSession, method: str, url: str, route: str,
                       body: Mapping[str, Any] | None) -> Reply:
        attempt, last = 0, Reply(url, 0, {"error": {"type": "NotSent", "message": "no attempt made"}})
        while attempt <= self.retries:
            attempt += 1
            try:
                data = None if body is None else json.dumps(body).encode()
                async with session.request(method, url.rstrip("/") + route, data=data,
                                           headers=self.headers()) as resp:
                    try:
                        payload = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        payload = {"error": {"type": "HTTPError", "message": (await resp.text())[:500]}}
                    last = Reply(url, resp.status, payload if isinstance(payload, dict) else {"body": payload},
                                 attempt)
                    if resp.status not in RETRY_STATUSES:
                        return last
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                last = Reply(url, 0, {"error": {"type": type(exc).__name__, "message": str(exc) or repr(exc)}},
                             attempt)
                if isinstance(exc, asyncio.TimeoutError):
                    return last  # the engine may still be applying: do not send it twice
            await asyncio.sleep(self.backoff_s * attempt)
        return last

    async def _many(self, method: str, route: str, bodies: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Reply]:
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            urls = list(bodies)
            replies = await asyncio.gather(*(self._request(session, method, u, route, bodies[u]) for u in urls))
        return dict(zip(urls, replies))

    def _run(self, coro):
        return asyncio.run(coro)

    def update(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        """`POST /update_weights_delta` to each engine (url -> body), concurrently."""
        return self._run(self._many("POST", UPDATE_ROUTE, bodies))

    def status(self, urls: Sequence[str]) -> dict[str, Reply]:
        return self._run(self._many("GET", STATUS_ROUTE, {u: None for u in urls}))

    def collective_init(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, Reply]:
        return self._run(self._many("POST", COLLECTIVE_INIT_ROUTE, bodies))
