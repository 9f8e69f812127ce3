"""Engine calls that end when an engine core dies.

Why: vLLM 0.32's async client never fails a pending utility call when an engine core process
dies. Its monitor thread (`MPClient.start_engine_core_monitor`) sets `resources.engine_dead` and
shuts the client down, but the futures in `utility_results` stay pending. Under DP + EP on the
CPU build, the pause before a commit made both engines die, and the update request hung until
the server was killed: uvicorn's graceful shutdown, which vLLM's watchdog starts on a dead
engine, waits for that request forever. Every engine call of the route goes through `while_alive`,
which polls the flag and raises vLLM's own `EngineDeadError`: vLLM's handler answers it (500) and
shuts the server down, as for a generate request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from vllm.v1.engine.exceptions import EngineDeadError

T = TypeVar("T")

POLL_S = 0.5  # how often a pending call looks at the engine's liveness flag


def engine_dead(engine: Any) -> bool:
    """Whether vLLM's client has seen an engine core die (False for clients without the flag)."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


async def while_alive(engine: Any, call: Awaitable[T]) -> T:
    """`await call`, unless an engine core dies first: then the call is cancelled and
    `EngineDeadError` raised. A cancelled caller cancels the call too."""
    if engine_dead(engine):
        if asyncio.iscoroutine(call):
            call.close()
        raise EngineDeadError()
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if engine_dead(engine):
                task.cancel()
                raise EngineDeadError()
    except asyncio.CancelledError:
        task.cancel()
        raise
