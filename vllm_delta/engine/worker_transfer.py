"""How a worker's prepare runs: on a background thread (`collective_rpc` runs inside the engine core's
busy loop, so the core polls it), and for a delta not on disk, received from the trainer's collective
group or pulled from the object store, admitted before any flush moves.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vllm_delta.engine.messages import PrepareRequest, failure
from vllm_delta.engine.staging import StagedUpdate
from vllm_delta.wire import DeltaError, Manifest, parse_manifest

logger = logging.getLogger(__name__)
Stage = Callable[[Manifest, Iterable[Any]], StagedUpdate]  # the applier's prepare, for one update


def prepare_threads() -> int:
    """Intra-op threads for a background prepare: at most half the engine's, so generation keeps a share."""
    return max(1, min(4, torch.get_num_threads() // 2))


def decode_threads(model: torch.nn.Module) -> int:
    """Flushes a prepare decodes at once: on CPU the prepare's share (the cores run the forward passes);
    an accelerator's host cores are mostly idle, so each local rank takes its share of them, up to 8."""
    device = next(model.parameters()).device
    if device.type in ("cpu", "meta"):
        return prepare_threads()
    local = max(1, torch.accelerator.device_count())
    return max(1, min(8, len(os.sched_getaffinity(0)) // local))


class Preparing(threading.Thread):
    """A prepare on a background thread with its share of intra-op threads; `reply` is set when it ends."""

    def __init__(self, request_id: str, prepare: Callable[[], dict[str, Any]]) -> None:
        super().__init__(name="delta-prepare", daemon=True)
        self.request_id, self.prepare, self.threads = request_id, prepare, prepare_threads()
        self.began, self.reply = time.perf_counter(), {}
        self.start()

    def run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's OpenMP pool; the engine's own is untouched
        try:
            self.reply = self.prepare()
        except Exception as exc:  # prepare reports input errors itself; anything else is ours
            logger.exception("delta updates: prepare crashed")
            self.reply = failure(500, exc)


def receive(
    group: Any, request: PrepareRequest, admit: Callable[[Manifest], object], stage: Stage
) -> tuple[Manifest, StagedUpdate]:
    """Answer the trainer's offer (refused before any flush moves), then decode each flush as it arrives,
    one in memory at a time. Any failure is a `DeltaError`, after which the caller drops the group."""
    from vllm_delta.settings import collective_max_flush_bytes
    from vllm_delta.transports.collective import CollectiveError, answer

    if group is None:
        raise CollectiveError(
            "no collective group: the trainer must POST /delta_updates/collective/init first"
        )
    offered = request.manifest

    def check() -> Manifest:
        manifest = parse_manifest(json.dumps(offered).encode())
        admit(manifest)  # the worker's versions and run (wire.lineage), before any flush moves
        return manifest

    try:
        receiver, manifest = answer(group, offered, request.version, collective_max_flush_bytes(), check)
        try:
            staged = stage(manifest, receiver)
        except DeltaError:
            receiver.drain()  # the flushes after a refused one, so the trainer's stream ends
            raise
    except DeltaError:
        raise
    except Exception as exc:
        raise CollectiveError(f"{type(exc).__name__}: {exc}") from exc
    return manifest, staged


def pull(
    store: Any, path: str, admit: Callable[[Manifest], object], owned: Any, stage: Stage
) -> tuple[Manifest, StagedUpdate]:
    """Fetch the version at `path` under this engine's own store root (checked again here), a flush
    fetched ahead while the last decodes, sparse (the `owned` blocks) where transports/s3.py says it pays."""
    from vllm_delta.engine.request import store_version_key
    from vllm_delta.transports.s3 import StoreFlushes, fetch_manifest

    prefix = store_version_key(path, store.url)
    manifest, manifest_bytes = fetch_manifest(store, prefix)
    admit(manifest)  # before any flush is fetched
    with StoreFlushes(store, prefix, manifest.files, manifest=manifest, owned=owned) as flushes:
        staged = stage(manifest, flushes)
    staged.bytes_read = manifest_bytes + flushes.fetched_bytes  # what came over the network
    return manifest, staged
