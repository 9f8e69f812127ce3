"""`while_alive`: an engine call ends when vLLM's client marks an engine core dead.

The real fault (both DP engines dying in the pause) is produced in test_data_parallel_moe.py; these
check the helper's own edges: the flag read where vLLM keeps it, a call already started is
cancelled, a dead engine is not called at all, and a cancelled caller cancels its call.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_delta.engine import transaction


def client(dead: bool = False) -> SimpleNamespace:
    """The attribute path vLLM 0.32's AsyncLLM exposes: engine_core.resources.engine_dead."""
    return SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=dead)))


@pytest.fixture(autouse=True)
def fast_poll(monkeypatch):
    monkeypatch.setattr(transaction, "POLL_S", 0.01)


def test_a_call_that_answers_returns_its_value():
    async def answer():
        await asyncio.sleep(0.03)
        return 7

    assert asyncio.run(transaction.while_alive(client(), answer())) == 7


async def never(cancelled: asyncio.Event) -> None:
    """A call that only ends by cancellation, which it records."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        cancelled.set()
        raise


def test_a_pending_call_is_cancelled_when_the_engine_dies():
    engine, cancelled = client(), asyncio.Event()

    async def scenario():
        call = asyncio.ensure_future(transaction.while_alive(engine, never(cancelled)))
        await asyncio.sleep(0.05)
        assert not call.done()
        engine.engine_core.resources.engine_dead = True
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(call, 5)
        await asyncio.sleep(0)
        return cancelled.is_set()

    assert asyncio.run(scenario())


def test_a_dead_engine_is_not_called():
    started = []

    async def call():
        started.append(1)

    with pytest.raises(EngineDeadError):
        asyncio.run(transaction.while_alive(client(dead=True), call()))
    assert started == []


def test_a_cancelled_caller_cancels_the_call():
    cancelled = asyncio.Event()

    async def scenario():
        call = asyncio.ensure_future(transaction.while_alive(client(), never(cancelled)))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0)
        return cancelled.is_set()

    assert asyncio.run(scenario())


def test_a_client_without_the_flag_is_alive():
    async def answer():
        return "ok"

    assert asyncio.run(transaction.while_alive(SimpleNamespace(), answer())) == "ok"
