"""`EngineClient` from async code: the sync wrapper called inside a running loop.

Why a real server: the failure this guards against (`asyncio.run` inside a running event loop, as
in Ray async actors and async rollout loops) only shows with a real request. The aiohttp server runs
on its own loop in a thread, so a sync call that blocks the caller's loop cannot starve it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from vllm_delta.client import STATUS_ROUTE, UPDATE_ROUTE, EngineClient

API_KEY = "client-test-key"


class EchoEngine:
    """A real aiohttp server with the engine's two routes: it checks the key and echoes the body."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "echo engine did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post(UPDATE_ROUTE, self._update)
        app.router.add_get(STATUS_ROUTE, self._status)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {API_KEY}"

    async def _update(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"type": "Unauthorized", "message": "key"}}, status=401)
        body = await request.json()
        self.requests.append(body)
        return web.json_response({"version": body["version"], "changed": 3})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"version": len(self.requests), "healthy": True, "ranks": [{}]})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def engines() -> Iterator[list[EchoEngine]]:
    started = [EchoEngine(), EchoEngine()]
    yield started
    for e in started:
        e.stop()


def test_sync_wrapper_works_inside_a_running_event_loop(engines):
    """As a Ray async actor would: sync calls from a coroutine (today: `asyncio.run` RuntimeError)."""
    client = EngineClient(API_KEY, timeout_s=10, retries=0)
    urls = [e.url for e in engines]

    async def actor_step() -> tuple[dict, dict]:
        replies = client.update({u: {"path": "weight_v000001", "version": 1} for u in urls})
        return replies, client.status(urls)

    replies, status = asyncio.run(actor_step())
    assert all(r.ok and r.body == {"version": 1, "changed": 3} for r in replies.values()), replies
    assert all(s.ok and s.body["version"] == 1 for s in status.values()), status
    assert all(e.requests == [{"path": "weight_v000001", "version": 1}] for e in engines)


def test_sync_wrapper_outside_a_loop_and_errors_come_back_as_replies(engines):
    client = EngineClient("wrong-key", timeout_s=10, retries=0)
    reply = client.update({engines[0].url: {"path": "weight_v000001", "version": 1}})[engines[0].url]
    assert reply.status == 401 and reply.error["type"] == "Unauthorized"
    assert engines[0].requests == []
