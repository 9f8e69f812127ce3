"""How a worker's prepare gets a delta that is not on its disk: received from the trainer's
collective group, or pulled from the engine's object store.

Why apart from the worker: both are the same three steps around `DeltaApplier.prepare_flushes`
(manifest, lineage check before any flush moves, flushes decoded as they arrive), with the
transport's own setup and teardown; the worker only holds the group and the store client.
The transports are imported when used, so an engine that uses neither never loads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_delta.engine.apply import DeltaApplier, StagedUpdate
from vllm_delta.engine.messages import PrepareRequest
from vllm_delta.wire import DeltaError, Manifest, parse_manifest


@dataclass
class Arriving:
    """One prepare of a delta that is not on disk: its request, this rank's applier, version and staging
    bound, and the worker's check of a manifest (signature, then lineage: worker._delta_admit)."""

    request: PrepareRequest
    applier: DeltaApplier
    current_version: int
    max_staged: int
    admit: Callable[[Manifest], object]

    def stage(self, manifest: Manifest, flushes: Iterable[Any]) -> StagedUpdate:
        r = self.request
        return self.applier.prepare_flushes(
            manifest,
            flushes,
            version=r.version,
            base_version=r.base_version,
            current_version=self.current_version,
            max_staged_bytes=self.max_staged,
        )


def receive(group: Any, job: Arriving) -> tuple[Manifest, StagedUpdate]:
    """Answer the trainer's offer (accept, or refuse before any flush moves), then decode each flush
    as it arrives and drop it: one flush in memory at a time (transports/collective.py). Any failure
    is a `DeltaError`, after which the caller drops the group (the trainer drops its end)."""
    from vllm_delta.settings import collective_max_flush_bytes
    from vllm_delta.transports.collective import CollectiveError, answer

    if group is None:
        raise CollectiveError(
            "no collective group: the trainer must POST /delta_updates/collective/init first"
        )
    offered = job.request.manifest

    def check() -> Manifest:
        manifest = parse_manifest(json.dumps(offered).encode())
        job.admit(manifest)  # the worker's versions and run (wire.lineage), before any flush moves
        return manifest

    try:
        receiver, manifest = answer(group, offered, job.request.version, collective_max_flush_bytes(), check)
        try:
            staged = job.stage(manifest, receiver)
        except DeltaError:
            receiver.drain()  # the flushes after a refused one, so the trainer's stream ends
            raise
    except DeltaError:
        raise
    except Exception as exc:
        raise CollectiveError(f"{type(exc).__name__}: {exc}") from exc
    return manifest, staged


def pull(store: Any, job: Arriving) -> tuple[Manifest, StagedUpdate]:
    """Fetch the version from this engine's own store root (the route checked the relative path):
    the manifest, the lineage check, then the flushes, one fetched ahead while the last decodes,
    each sparse (only the blocks this rank decodes) where transports/s3.py says that is safe and pays."""
    from vllm_delta.engine.request import store_version_key
    from vllm_delta.transports.s3 import StoreFlushes, fetch_manifest

    prefix = store_version_key(job.request.store_path, store.url)  # checked again, under this worker's root
    manifest, manifest_bytes = fetch_manifest(store, prefix)
    job.admit(manifest)  # before any flush is fetched
    owned = job.applier.owned_ranges()  # what prepare_flushes decodes
    with StoreFlushes(store, prefix, manifest.files, manifest=manifest, owned=owned) as flushes:
        staged = job.stage(manifest, flushes)
    staged.bytes_read = manifest_bytes + flushes.fetched_bytes  # what came over the network
    return manifest, staged
