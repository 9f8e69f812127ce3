"""A small real engine process for the sender's fault tests: `python engine_process.py WEIGHTS ROOT MODE`.

Why not vLLM: a killed or SIGSTOPped engine needs a real process, but what the sender sees of it
(its status and update routes, its version and lineage rules, the delta files it decodes) is all
it needs. This serves `sender_helpers.FakeEngine` (real HTTP, real wire decoding, the engine's own
lineage function) in a process of its own, on `WEIGHTS` (a safetensors file) and delta root `ROOT`,
and prints its URL on stdout.

MODE "join-then-stop" also answers the collective init route the way an engine rank that joined
and then went away does: it joins the trainer's store, says it joined, and never sets up the bulk
channel (so the trainer's side waits in gloo's, or NCCL's, setup).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from aiohttp import web
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sender"))
from sender_helpers import FakeEngine  # noqa: E402


class JoinThenStop(FakeEngine):
    def __init__(self, root: Path, weights) -> None:
        super().__init__(root, weights)
        self.inits = 0

    async def collective_init(self, request):
        body = await request.json()
        self.inits += 1
        threading.Thread(target=self._join, args=(body,), daemon=True).start()
        return web.json_response({"ok": True})

    def _join(self, body) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        spg = StatelessProcessGroup.create(
            body["master_addr"],
            body["master_port"],
            1,
            body["world_size"],
            store_timeout=max(1, int(body["timeout_s"])),
        )
        spg.store.set("vllm-delta/joined/1", b"true")
        time.sleep(3600)  # never builds the bulk channel


def main() -> None:
    weights, root, mode = load_file(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    engine = JoinThenStop(root, weights) if mode == "join-then-stop" else FakeEngine(root, weights)
    if mode == "join-then-stop":
        app = web.Application()
        app.router.add_post("/update_weights_delta", engine.update)
        app.router.add_get("/delta_updates/status", engine.status)
        app.router.add_post("/delta_updates/collective/init", engine.collective_init)
        engine.close()
        runner = web.AppRunner(app)
        engine.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        engine.loop.run_until_complete(site.start())
        engine.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        threading.Thread(target=engine.loop.run_forever, daemon=True).start()
    print(engine.url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
