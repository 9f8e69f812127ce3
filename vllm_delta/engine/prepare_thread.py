"""The background prepare: the thread a prepare runs on, and how many cores it may take.

Why apart from the worker: `collective_rpc` runs inside the engine core's busy loop, so the worker
starts a prepare here and polls it; the thread counts decide how much of the host it takes from
generation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_delta.engine.messages import failure

logger = logging.getLogger(__name__)


def prepare_threads() -> int:
    """Intra-op threads for a background prepare: at most half of the engine's, so generation keeps a
    share."""
    return max(1, min(4, torch.get_num_threads() // 2))


def decode_threads(model: torch.nn.Module) -> int:
    """Flushes a prepare decodes at once. A CPU engine's cores run its forward passes, so it takes the
    prepare's share (`prepare_threads`); an accelerator's host cores are mostly idle (vLLM runs its
    workers at one torch thread, so the intra-op count says nothing), so each local rank takes its
    share of the cores it may run on, up to 8."""
    device = next(model.parameters()).device
    if device.type in ("cpu", "meta"):
        return prepare_threads()
    local = max(1, torch.accelerator.device_count())
    return max(1, min(8, len(os.sched_getaffinity(0)) // local))


@dataclass
class Preparing:
    """A prepare running on a background thread with `threads` intra-op threads; `reply` is set when it
    ends."""

    request_id: str
    threads: int
    started: float = field(default_factory=time.perf_counter)
    reply: dict[str, Any] | None = None
    thread: threading.Thread | None = None

    def start(self, prepare: Callable[[], dict[str, Any]]) -> None:
        def run() -> None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP pool; the engine's own is untouched
            try:
                self.reply = prepare()
            except Exception as exc:  # prepare reports input errors itself; anything else is ours
                logger.exception("delta updates: prepare crashed")
                self.reply = failure(500, exc)

        self.thread = threading.Thread(target=run, name="delta-prepare", daemon=True)
        self.thread.start()
