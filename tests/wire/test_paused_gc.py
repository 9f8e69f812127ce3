"""`paused_gc` from several threads at once never leaves the garbage collector off.

The interleaving that did (issue 33): B reads "off" while A holds the pause, A ends and turns
collection back on, then B turns it off and, having read "off", never turns it on again. The
test forces that order by making B's `gc.disable` wait until A has left.
"""

from __future__ import annotations

import gc
import threading
import types

import pytest

from vllm_delta.wire import container


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_overlapping_pauses_restore_the_collector(monkeypatch, collector_on):
    a_inside, a_left = threading.Event(), threading.Event()
    b_thread: list[threading.Thread] = []

    def disable() -> None:
        if threading.current_thread() in b_thread:
            a_left.wait(5)  # B's disable lands after A turned collection back on
        gc.disable()

    monkeypatch.setattr(
        container, "gc", types.SimpleNamespace(isenabled=gc.isenabled, enable=gc.enable, disable=disable)
    )

    def a() -> None:
        with container.paused_gc():
            a_inside.set()
            b_entered.wait(5)

    def b() -> None:
        a_inside.wait(5)
        b_entered.set()
        with container.paused_gc():
            assert not gc.isenabled()

    b_entered = threading.Event()
    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    b_thread.append(tb)
    ta.start(), tb.start()
    ta.join(10)
    a_left.set()
    tb.join(10)
    assert gc.isenabled()


def test_nested_and_sequential_pauses(collector_on):
    with container.paused_gc():
        with container.paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with container.paused_gc():
        pass
    assert not gc.isenabled()  # a collector that was off stays off
    gc.enable()
