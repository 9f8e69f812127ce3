"""S3 transport: flush objects under `s3://BUCKET/PREFIX/<version dir>/`, uploaded as they are encoded,
the manifest last, then one HTTP push per engine naming the version dir (as with disk).

Why the store: between datacenters there is no shared filesystem and no collective, but there is an
object store, and it does the fan-out. A version without its manifest is invisible, so a sender that
dies mid-upload never shows a half version. Versions stay until every engine acknowledged them, plus
the chain late joiners replay (`catch_up`); docs/sender.md has the layout, faults and lifecycle. The
engine's half is transports/s3_receive.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm_delta.client import EngineClient, Reply
from vllm_delta.transports.base import SentDelta, Sink, Transport, TransportOptions
from vllm_delta.transports.store import ObjectStore, StoreAuthError, StoreError, StoreNotFound, StoreURL
from vllm_delta.transports.writer import BackgroundFlushWriter
from vllm_delta.wire import MANIFEST_NAME, FlushBuilder, Manifest

logger = logging.getLogger(__name__)


def put_retrying(store: ObjectStore, key: str, data: bytes, *, attempts: int, backoff_s: float) -> None:
    """PUT one object, retrying the whole object with exponential backoff on store errors; wrong
    credentials or a missing bucket are not retried (they would not heal by waiting)."""
    for i in range(attempts):
        try:
            store.put(key, data)
            return
        except (StoreAuthError, StoreNotFound):
            raise
        except StoreError as exc:
            if i == attempts - 1:
                raise
            logger.warning(
                "delta sender: upload of %s failed (%s); retry %d of %d", key, exc, i + 1, attempts - 1
            )
            time.sleep(backoff_s * 2**i)


@dataclass
class Stored:
    """A sealed version in the store, as the lifecycle and the catch-up need it."""

    name: str  # version dir
    version: int
    kind: str
    base_version: int | None
    min_version: int | None  # lineage range (None: an anchor, valid on any weights)
    max_version: int | None

    def applies_at(self, version: int) -> bool:
        if self.base_version is not None and self.base_version != version:
            return False
        return self.min_version is None or self.min_version <= version <= self.max_version

    def body(self) -> dict[str, Any]:
        return {"path": self.name, "version": self.version, "base_version": self.base_version}


class S3Transport(Transport):
    """Flush objects under `url/<version dir>`, one HTTP push per engine naming that version dir."""

    stored = True  # every rank uploads its own flushes into the same version dir; rank 0 seals it

    def __init__(self, name: str, options: TransportOptions) -> None:
        url = str(options.delta_dir or "")
        if not url.startswith("s3://"):
            raise ValueError(
                f"the s3 transport needs delta_dir='s3://BUCKET/PREFIX', not {options.delta_dir!r}"
            )
        self.url = StoreURL.parse(url)
        self.store = ObjectStore(self.url, throttle_bytes_per_s=options.throttle_bytes_per_s)
        self.planner, self.keep, self.keep_chain = options.planner, options.keep, 16
        self.attempts, self.backoff_s = 4, 1.0  # per object, on top of botocore's own retries
        self.sealed: dict[str, Stored] = {}
        self.unsealed: set[str] = set()  # prepared, never sealed (a failed sync): deleted at the next cleanup
        self.checkpoint_chain = options.version == 0  # version 0 is the checkpoint every engine starts from

    @property
    def uploaded_bytes(self) -> int:
        return self.store.uploaded_bytes

    def prepare(self, name: str) -> None:
        """Rank 0, before any rank uploads: no leftover objects (e.g. of a sender that died), manifest
        first."""
        self.sealed.pop(name, None)
        self.unsealed.add(name)
        self._remove(name)  # raises: a leftover manifest must go

    def sink(self, name: str, **kwargs) -> Sink:
        dir_key = self.url.key(name)
        uploader = BackgroundFlushWriter(
            lambda flush, data: put_retrying(
                self.store, f"{dir_key}/{flush}", data, attempts=self.attempts, backoff_s=self.backoff_s
            ),
            name="vllm-delta-uploader",
        )
        return Sink(FlushBuilder(uploader.emit, **kwargs), name, writer=uploader)

    def seal(self, sent: SentDelta) -> None:
        """The manifest last: only now may an engine see the version."""
        m: Manifest = sent.manifest
        put_retrying(
            self.store,
            self.url.key(sent.location, MANIFEST_NAME),
            m.model_dump_json(indent=1).encode(),
            attempts=self.attempts,
            backoff_s=self.backoff_s,
        )
        self.unsealed.discard(sent.location)
        lin = m.lineage
        lo, hi = (lin.min_version, lin.max_version) if lin else (None, None)
        self.sealed[sent.location] = Stored(sent.location, m.version, sent.kind, m.base_version, lo, hi)

    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        return client.update({u: {"path": s.location, **body} for u, (s, body) in targets.items()})

    # ---- lifecycle ---------------------------------------------------------------------------
    def chain(self) -> tuple[int, list[Stored]] | None:
        """(start version, the versions after it) an engine can replay: the latest anchor, or the
        checkpoint if no anchor was sent yet; None when no chain is kept."""
        ordered = sorted(self.sealed.values(), key=lambda s: s.version)
        anchors = [s for s in ordered if s.kind == "anchor"]
        if anchors:
            start = anchors[-1]
            after = [s for s in ordered if s.kind != "anchor" and s.version > start.version]
            return (start.version, [start] + after) if len(after) <= self.keep_chain else None
        if not self.checkpoint_chain:
            return None
        return (0, ordered) if len(ordered) <= self.keep_chain else None

    def catch_up(self, status: dict[str, Any], target: int) -> list[dict[str, Any]] | None:
        """The pushes that take an engine in `status` to `target` from the kept chain, in order; None
        if the chain does not reach it (the planner then anchors the engine as before)."""
        chain = self.chain()
        if chain is None or target == 0:
            return None
        start, versions = chain
        v = status.get("version")
        if versions and versions[0].kind == "anchor":
            if v is None or v > start:  # an engine accepts no version below its own
                return None
            reach, rest = {start: versions[:1]}, versions[1:]
        elif (
            start == 0 and v == 0 and status.get("run_id") is None
        ):  # on the checkpoint, which starts the chain
            reach, rest = {0: []}, versions
        else:
            return None
        for s in rest:  # each version, by the replay of the latest reachable version it applies to
            for u in sorted(reach, reverse=True):
                if u < s.version and s.version not in reach and s.applies_at(u):
                    reach[s.version] = reach[u] + [s]
                    break
        steps = reach.get(target)
        return [s.body() for s in steps] if steps else None

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Delete every version all engines have moved past, except the kept chain."""
        if self.keep or self.planner is None:
            return
        for name in self.unsealed - {s.location for s in sent}:
            if self._delete(name):
                self.unsealed.discard(name)
        engines = list(self.planner.engines.values())
        chain = self.chain()
        kept = {s.name for s in chain[1]} if chain else set()
        for name, s in list(self.sealed.items()):
            done = all(e.needs_anchor or (e.acked is not None and e.acked >= s.version) for e in engines)
            if done and name not in kept and self._delete(name):
                del self.sealed[name]
        if chain is None:
            self.checkpoint_chain = False  # versions of the checkpoint's chain are gone: it never comes back

    def _remove(self, name: str) -> None:
        """One version dir, manifest first so no reader sees it as finished."""
        self.store.delete_prefix(self.url.key(name, MANIFEST_NAME))
        self.store.delete_prefix(self.url.key(name) + "/")

    def _delete(self, name: str) -> bool:
        """`_remove`, or False if the store failed (the sync that pushed stays good: the next cleanup
        tries again)."""
        try:
            self._remove(name)
        except StoreError as exc:
            logger.warning("delta sender: could not delete %s from the store (%s); retrying later", name, exc)
            return False
        return True
