"""Which engine gets what: a base-relative delta, an overwrite catch-up, or a full anchor.

Why the snapshot moves only on a full ack: the seed advanced it before the engines applied, so a
failed apply was never re-sent and that engine drifted for good. Here the snapshot stays at S, the
last version every engine acknowledged. While some engine lags, the sender remembers the positions
it sent since S (the producer's `pending`) and sends everyone an *overwrite* catch-up: current
values at diff(current, S) ∪ pending. Any engine whose weights are some version in [S, N-1] of
this lineage ends exactly at N after applying it (a position that differs between its version and
N was changed since S, so it is in one of the two sets), and an overwrite delta is safe to replay.
Engines outside the lineage (restarted at version 0, pushed ahead by someone else, newly added)
get a full anchor. In the steady state (every engine at S) the configured, base-relative encoding
(`ulp_zstd`) is used. docs/sender.md has the state machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_delta.client import EngineClient, Reply
from vllm_delta.wire import get_encoding

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """What the sender knows of one engine."""

    url: str
    acked: int | None = 0  # last version it acknowledged; None: unknown (ask its status first)
    needs_anchor: bool = False
    last_error: dict[str, Any] | None = None
    last_status: int | None = None
    skipped: bool = False  # unreachable or dirty at plan time: not sent to this sync


@dataclass
class Plan:
    version: int
    kind: str  # "delta" (base-relative from S, everyone at S) | "catchup" (overwrite) | "" (none)
    encoding: str
    base_version: int | None
    delta_urls: list[str] = field(default_factory=list)
    anchor_urls: list[str] = field(default_factory=list)


class Planner:
    """Engine bookkeeping: versions sent and acknowledged, anchors owed."""

    def __init__(self, engines: list[str], client: EngineClient, *, encoding: str, overwrite_encoding: str,
                 anchor_every: int | None, version: int) -> None:
        if get_encoding(overwrite_encoding).needs_base:
            raise ValueError(f"overwrite_encoding {overwrite_encoding!r} must not be base-relative")
        get_encoding(encoding)
        self.engines = {u: EngineState(u, acked=version) for u in engines}
        self.client = client
        self.encoding, self.overwrite_encoding, self.anchor_every = encoding, overwrite_encoding, anchor_every
        self.version = version  # last version sent
        self.snapshot_version = version  # S: every engine acknowledged it
        self.anchor_next = False

    def add_engine(self, url: str) -> None:
        self.engines[url] = EngineState(url, acked=None, needs_anchor=True)

    def plan(self) -> Plan:
        """Ask lagging engines where they are; decide who gets a delta, a catch-up or an anchor."""
        version = self.version + 1
        S = self.snapshot_version
        unknown = [e for e in self.engines.values() if e.acked is None]
        for e in self.engines.values():
            e.skipped = False
        if unknown:
            for url, r in self.client.status([e.url for e in unknown]).items():
                e = self.engines[url]
                if not r.ok:
                    e.skipped, e.last_status, e.last_error = True, r.status, r.error
                    continue
                v = r.body.get("version")
                if not r.body.get("healthy") or v is None:
                    e.skipped, e.last_error = True, {"type": "Unhealthy", "message": str(r.body.get("dirty_reasons"))}
                elif not e.needs_anchor and S <= v <= self.version:
                    e.acked = v
                else:
                    e.needs_anchor = True
                    version = max(version, v + 1)  # an engine ahead of us accepts only later versions
        live = [e for e in self.engines.values() if not e.skipped]
        anchor_all = self.anchor_next or bool(self.anchor_every and version % self.anchor_every == 0)
        anchors = [e.url for e in live if anchor_all or e.needs_anchor]
        deltas = [e.url for e in live if e.url not in anchors]
        if all(self.engines[u].acked == S for u in deltas):
            kind, enc = "delta", self.encoding
        else:
            kind, enc = "catchup", self.overwrite_encoding
        base = S if get_encoding(enc).needs_base else None
        return Plan(version, kind if deltas else "", enc, base, deltas, anchors)

    def settle(self, plan: Plan, replies: dict[str, Reply]) -> bool:
        """Record acks; True if every engine now holds `plan.version` (the snapshot may advance)."""
        for url, r in replies.items():
            e = self.engines.get(url)
            if e is None:
                continue
            e.last_status = r.status
            if r.ok and r.body.get("version") == plan.version:
                e.acked, e.needs_anchor, e.last_error = plan.version, False, None
            else:
                e.acked, e.last_error = None, r.error  # unknown: ask its status before the next sync
                logger.warning("delta sender: %s did not apply version %d (%s): %s", url, plan.version, r.status,
                               r.error)
        self.version = plan.version
        if plan.anchor_urls and all(u in plan.anchor_urls for u in self.engines):
            self.anchor_next = False
        all_acked = all(e.acked == plan.version for e in self.engines.values())
        if all_acked:
            self.snapshot_version = plan.version
            self.anchor_next = False
        return all_acked
