"""Sender test helpers: a fake engine (real aiohttp server, real wire decoding) and an Adam-like step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from aiohttp import web

from vllm_delta.wire import DeltaError, check_lineage, check_versions, get_encoding, open_delta, read_delta


class FakeEngine:
    """The engine route's version and lineage rules on a dict of tensors, served over real HTTP.

    The version and lineage rule is the engine workers' own (`wire.lineage`), not a copy.

    `fail_versions`: versions it answers with a 500 before applying (a real engine error's shape).
    `lose_reply_versions`: versions it applies and then answers 503, as a proxy that lost the reply would.
    """

    def __init__(self, root: Path, weights: dict[str, torch.Tensor]) -> None:
        self.root, self.weights = root, {k: v.clone() for k, v in weights.items()}
        self.version, self.fail_versions, self.requests = 0, set(), []
        self.run_id: str | None = None
        self.lose_reply_versions: set[int] = set()
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/update_weights_delta", self.update)
        app.router.add_get("/delta_updates/status", self.status)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def restart(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights, self.version, self.run_id = {k: v.clone() for k, v in weights.items()}, 0, None

    async def status(self, request):
        return web.json_response(
            {
                "version": self.version,
                "run_id": self.run_id,
                "healthy": True,
                "dirty_reasons": [],
                "ranks": [{}],
            }
        )

    async def update(self, request):
        body = await request.json()
        self.requests.append(body)
        if body["version"] in self.fail_versions:
            self.fail_versions.discard(body["version"])
            return web.json_response({"error": {"type": "EngineError", "message": "injected"}}, status=500)
        try:
            info = open_delta(self.root / body["path"])
            enc = get_encoding(info.manifest.encoding)
            v, cur = body["version"], self.version
            listed = {p.name: p.changed for p in info.manifest.params}
            anchor = enc.idempotent and all(listed.get(k) == t.numel() for k, t in self.weights.items())
            run_id = check_lineage(
                info.manifest.lineage, version=v, engine_version=cur, engine_run_id=self.run_id, anchor=anchor
            )
            check_versions(
                info.manifest, version=v, base_version=body.get("base_version"), engine_version=cur
            )
            deltas = read_delta(info, current_version=cur if enc.needs_base else None)
        except DeltaError as exc:
            return web.json_response(
                {"error": {"type": type(exc).__name__, "message": str(exc)}}, status=exc.http_status
            )
        for d in deltas:
            d.apply_(self.weights[d.name])
        self.version, self.run_id = v, run_id
        if v in self.lose_reply_versions:
            self.lose_reply_versions.discard(v)
            return web.json_response({"error": {"type": "BadGateway", "message": "reply lost"}}, status=503)
        return web.json_response(
            {
                "version": v,
                "changed": sum(d.count for d in deltas),
                "bytes_read": 0,
                "decode_s": 0.0,
                "apply_s": 0.0,
                "pause_s": 0.0,
                "replay": False,
                "fallback": [],
                "ranks": [],
            }
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def adam_like_step(weights: dict[str, torch.Tensor], gen: torch.Generator, density: float = 0.05) -> None:
    """Move a random `density` of elements by ±1 ULP, in place (reverts happen, as in training)."""
    for t in weights.values():
        bits = t.view(-1).view(torch.int16)
        mask = torch.rand(bits.shape, generator=gen) < density
        step = torch.where(torch.rand(bits.shape, generator=gen) < 0.5, 1, -1).to(torch.int16)
        bits[mask] += step[mask]


def engine_status(url: str, api_key: str) -> dict:
    """`GET /delta_updates/status` of a real engine."""
    import requests

    r = requests.get(
        f"{url}/delta_updates/status", headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    )
    r.raise_for_status()
    return r.json()


def engine_checksums(url: str, api_key: str) -> dict[str, str]:
    """vLLM's own per-parameter digests (`/weight_checker`, dev mode) of a real engine."""
    import requests

    r = requests.post(
        f"{url}/weight_checker",
        json={"action": "checksum"},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["checksums"]
