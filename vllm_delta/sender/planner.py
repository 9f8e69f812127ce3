"""Which engine gets what: a base-relative delta from S (the last version every engine acknowledged),
an overwrite catch-up (takes any version in [S, N-1] of this lineage exactly to N, safe to replay), or a
full anchor. docs/sender.md has the state machine, the correctness argument and the lineage rules."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from vllm_delta.client import EngineClient, Reply
from vllm_delta.wire import Lineage, get_encoding

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
    missed: int = 0  # consecutive syncs it did not acknowledge


@dataclass
class Plan:
    version: int
    kind: str  # "delta" (base-relative from S, everyone at S) | "catchup" (overwrite) | "" (none)
    encoding: str
    base_version: int | None
    delta_urls: list[str] = field(default_factory=list)
    anchor_urls: list[str] = field(default_factory=list)
    run_id: str = ""
    snapshot_version: int = 0  # S when planned
    replay: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # url: pushes before this plan's

    def lineage(self, kind: str) -> Lineage:
        """Which engine weights the `kind` update of this plan applies to."""
        if kind == "anchor":
            return Lineage(run_id=self.run_id)
        # a catch-up: every version this run sent since S (versions are never reused)
        top = self.version - 1 if kind == "catchup" else self.snapshot_version
        return Lineage(run_id=self.run_id, min_version=self.snapshot_version, max_version=top)


class Planner:
    """Engine bookkeeping: versions sent and acknowledged, anchors owed."""

    def __init__(
        self,
        engines: list[str],
        client: EngineClient,
        encoding: str,
        overwrite_encoding: str,
        anchor_every: int | None,
        version: int,
        max_lag_syncs: int,
    ) -> None:
        if get_encoding(overwrite_encoding).needs_base:
            raise ValueError(f"overwrite_encoding {overwrite_encoding!r} must not be base-relative")
        get_encoding(encoding)
        self.engines = {u: EngineState(u, acked=version) for u in engines}
        self.prober = Prober(client)
        self.encoding, self.overwrite_encoding, self.anchor_every = encoding, overwrite_encoding, anchor_every
        if max_lag_syncs < 1:
            raise ValueError("max_lag_syncs must be at least 1")
        self.max_lag_syncs = max_lag_syncs
        self.version = version  # last version sent
        self.snapshot_version = version  # S: every engine acknowledged it
        self.anchor_next = False
        # This sender's lineage, random per sender: a new one anchors engines it cannot vouch for,
        # unless it resumes their run.
        self.run_id = uuid.uuid4().hex
        self.resume = version > 0
        # The transport's (engine status, version to reach) -> pushes replaying a kept chain, or None.
        self.catch_up: Callable[[dict[str, Any], int], list[dict[str, Any]] | None] | None = None

    def add_engine(self, url: str) -> None:
        self.engines[url] = EngineState(url, acked=None, needs_anchor=True)
        self.prober.start([url])

    def plan(self, wait_s: float | None = None) -> Plan:
        """Take the status answers of engines in an unknown state (waiting at most `wait_s` for them,
        None: until they answer); decide who gets a delta, a catch-up or an anchor."""
        version = self.version + 1
        S = self.snapshot_version
        for e in self.engines.values():
            e.skipped = False
            if self.resume:  # the first plan of a resumed run: every engine's answer decides the run id
                e.acked = None
        wait_s = None if self.resume else wait_s
        unknown = [e for e in self.engines.values() if e.acked is None]
        replay: dict[str, list[dict[str, Any]]] = {}
        if unknown:
            # A blocking plan (wait_s None, `sync()`) asks afresh, as of now; else the latest answers.
            replies = self.prober.take([e.url for e in unknown], wait_s, fresh=wait_s is None)
            for e in unknown:
                if e.url not in replies:  # still being asked: not sent to this sync
                    e.skipped = True
                    e.last_error = {"type": "StatusPending", "message": "status probe in flight"}
            if self.resume:
                self._resume(replies)
            for url, r in replies.items():
                e = self.engines[url]
                if not r.ok:
                    e.skipped, e.last_status, e.last_error = True, r.status, r.error
                    continue
                v = r.body.get("version")
                if not r.body.get("healthy") or v is None:
                    e.skipped = True
                    e.last_error = {"type": "Unhealthy", "message": str(r.body.get("dirty_reasons"))}
                elif not e.needs_anchor and S <= v <= self.version and self.on_lineage(r.body, v):
                    e.acked = v
                else:
                    e.needs_anchor = True
                    version = max(version, v + 1)  # an engine ahead of us accepts only later versions
                    if self.catch_up is not None and (steps := self.catch_up(r.body, self.version)):
                        replay[url], e.acked, e.needs_anchor = steps, self.version, False
        live = [e for e in self.engines.values() if not e.skipped]
        anchor_all = self.anchor_next or bool(self.anchor_every and version % self.anchor_every == 0)
        anchors = [e.url for e in live if anchor_all or e.needs_anchor]
        deltas = [e.url for e in live if e.url not in anchors]
        if all(self.engines[u].acked == S for u in deltas):
            kind, enc = "delta", self.encoding
        else:
            kind, enc = "catchup", self.overwrite_encoding
        base = S if get_encoding(enc).needs_base else None
        replay = {u: steps for u, steps in replay.items() if u in deltas}
        return Plan(version, kind if deltas else "", enc, base, deltas, anchors, self.run_id, S, replay)

    def _resume(self, replies: dict[str, Reply]) -> None:
        """Take the run id the engines report at this sender's starting version, if they agree on one."""
        self.resume = False
        runs = {
            r.body.get("run_id")
            for r in replies.values()
            if r.ok and r.body.get("healthy") and r.body.get("version") == self.version
        } - {None}
        if len(runs) == 1:
            self.run_id = runs.pop()
        elif runs:
            logger.warning(
                "delta sender: engines at version %d are on runs %s; anchoring them", self.version, runs
            )

    def on_lineage(self, status: dict[str, Any], version: int) -> bool:
        """Whether an engine's status says it holds this run's `version` (no run id: it predates lineage)."""
        run_id = status.get("run_id", self.run_id)
        return run_id == self.run_id or (run_id is None and version == 0)  # the checkpoint: every run's 0

    def settle(self, plan: Plan, replies: dict[str, Reply]) -> bool:
        """Record acks; True if every engine now holds `plan.version` (the snapshot may advance)."""
        for url, r in replies.items():
            e = self.engines.get(url)
            if e is None:
                continue
            e.last_status = r.status
            if r.ok and r.body.get("version") == plan.version:
                e.acked, e.needs_anchor, e.last_error, e.missed = plan.version, False, None, 0
            else:
                e.acked, e.last_error = None, r.error  # unknown: ask its status before the next sync
                logger.warning(
                    "delta sender: %s did not apply version %d (%s): %s", url, plan.version, r.status, r.error
                )
        for e in self.engines.values():
            if e.acked != plan.version:
                e.missed += 1
                if e.missed >= self.max_lag_syncs and not e.needs_anchor:
                    self.drop(e, f"missed {e.missed} syncs")
        self.version = plan.version
        if plan.anchor_urls and all(u in plan.anchor_urls for u in self.engines):
            self.anchor_next = False
        # every engine that depends on the snapshot's lineage (all but those owed an anchor) is at it
        all_acked = all(e.acked == plan.version for e in self.engines.values() if not e.needs_anchor)
        if all_acked:
            self.snapshot_version = plan.version
            self.anchor_next = False
        return all_acked

    def probe_unknown(self) -> None:
        """Start asking every engine in an unknown state, so its answer is in by the next plan."""
        self.prober.start([e.url for e in self.engines.values() if e.acked is None])

    def drop(self, e: EngineState, why: str) -> None:
        """Stop holding the snapshot back for `e`; it gets a full anchor when it answers again."""
        logger.warning("delta sender: %s needs an anchor (%s); the snapshot moves on without it", e.url, why)
        e.needs_anchor, e.acked = True, None

    def drop_lagging(self, version: int, why: str) -> list[str]:
        """Drop every engine not at `version`; the snapshot may then advance to it."""
        lagging = [e for e in self.engines.values() if e.acked != version and not e.needs_anchor]
        for e in lagging:
            self.drop(e, why)
        self.snapshot_version = version
        return [e.url for e in lagging]


class Prober:
    """Engine status asked in the background, one probe in flight per engine, so training never waits on
    a dead or hung engine: the planner takes the answers that are in and skips the engines still asked."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._probes: dict[str, Future] = {}

    def start(self, urls: Iterable[str]) -> None:
        """Ask each engine's status unless a probe of it is already out."""
        with self._lock:
            for url in [u for u in dict.fromkeys(urls) if u not in self._probes]:
                future = self._probes[url] = Future()
                threading.Thread(
                    target=self._probe, args=(url, future), name="vllm-delta-probe", daemon=True
                ).start()

    def _probe(self, url: str, future: Future) -> None:
        try:
            future.set_result(self.client.status([url])[url])
        except BaseException as exc:  # a client error is an answer too: unreachable
            future.set_result(Reply(url, 0, {"error": {"type": type(exc).__name__, "message": str(exc)}}))

    def take(self, urls: Iterable[str], wait_s: float | None, *, fresh: bool = False) -> dict[str, Reply]:
        """The answers of `urls` in after waiting at most `wait_s` (None: until all are), each taken once.
        `fresh`: a new probe for each, since an answer or a probe in flight may predate the question (a
        probe begun while the engine was down answers "unreachable" after it came back)."""
        urls = list(urls)
        if fresh:
            with self._lock:
                for u in urls:
                    self._probes.pop(u, None)  # an older probe still running sets a future no one reads
        self.start(urls)
        with self._lock:
            futures = {u: self._probes[u] for u in urls}
        if futures and wait_s != 0:
            wait(futures.values(), timeout=wait_s)
        with self._lock:
            out = {u: f.result() for u, f in futures.items() if f.done()}
            for u in out:
                del self._probes[u]
        return out
