"""The hook's main-thread collectives never overlap the publish thread's (a hang found in test_engine_e2e).

Why a stand-in sender: the fault is an interleaving of two threads' collectives on one gloo group,
which a real run produces only by chance (the TP2 x EP2 engine test hung once in a dozen suites). The
stand-in records whether the previous publish had finished when the hook ran its rebind agreement
(`ranks.any`), which is what decides it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from megatron_hook.hook import HookHandle


class _Sender:
    def __init__(self) -> None:
        self.ranks = self
        self.future: Future | None = None
        self.seen: list[bool] = []  # at each agreement: was the last publish done?

    def any(self, flag: bool) -> bool:
        self.seen.append(self.future is None or self.future.done())
        return False

    def capture(self, segments):
        return None

    def wait(self) -> dict:
        return {}

    def publish(self) -> Future:
        self.future = Future()
        threading.Timer(0.3, self.future.set_result, args=({},)).start()  # a publish still running
        return self.future


class _Optimizer:
    def step(self):
        return True


def test_the_rebind_agreement_waits_for_the_publish_in_flight():
    sender = _Sender()
    hook = HookHandle(_Optimizer(), [torch.nn.Linear(2, 2)], sender, [], every=1, on_sync=None)
    for _ in range(3):
        hook.optimizer.step()
    assert sender.seen == [True, True, True]
    hook.remove()
