"""The collective update protocol: an offer, every engine rank's answer, a go/no-go, then the flushes.

Why a handshake before any bulk byte: an engine that refuses (lineage, version, sizes) must never
leave the trainer blocked in a broadcast nobody receives, and an engine must not receive a delta
it would refuse. So rank 0 announces what it will send (version, the manifest's digest and size,
each flush's name and size); every engine rank checks that against the manifest it got over HTTP
and answers; only if all accept does rank 0 say "go" and stream, one flush at a time. An engine
rank that fails while decoding keeps receiving (and dropping) the rest, so the stream always ends.

Keys, under the group's store, per update `seq`: `<seq>/offer`, `<seq>/answer/<rank>`, `<seq>/go`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, TypeVar

from vllm_delta.transports.groups import Group
from vllm_delta.wire import DeltaError
from vllm_delta.wire.errors import IncompleteDeltaError, LimitError

T = TypeVar("T")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest as JSON with sorted keys, the same on both ends of the HTTP request."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Refused(DeltaError):
    """Another rank of this engine refused the offer (its status, type and fields are kept)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(f"{answer['type']} on another rank: {answer['message']}", file=answer.get("file"),
                         param=answer.get("param"))
        self.http_status = int(answer["status"])


class CollectiveError(DeltaError):
    """The group broke (a peer left, a timeout): this engine drops it; the trainer rebuilds it."""

    http_status = 502


# ---- rank 0 -------------------------------------------------------------------------------------
def offer(group: Group, version: int, manifest: dict[str, Any], flushes: Iterable[tuple[str, int]],
          stop: Callable[[], bool]) -> bool:
    """Announce one update and collect the answers. True: every rank accepted (go, now stream);
    False: the engine answered its HTTP request without taking part (`stop()`), or a rank refused.
    `GroupTimeout` if the ranks stay silent past the group's timeout."""
    group.seq += 1
    group.bytes_sent, group.refusal = 0, None
    seq = group.seq
    group.put(f"{seq}/offer", {"version": version, "manifest_sha256": manifest_digest(manifest),
                               "manifest_bytes": len(json.dumps(manifest)), "flushes": [list(f) for f in flushes]})
    answers = group.wait_all([f"{seq}/answer/{r}" for r in range(1, group.world_size)],
                             time.monotonic() + group.timeout_s, stop)
    if answers is None:
        return False
    refusal = group.refusal = next((a for a in answers if not a["ok"]), None)
    group.put(f"{seq}/go", {"go": refusal is None, "refusal": refusal})
    return refusal is None


def stream(group: Group, flushes: Iterable[bytes]) -> None:
    """After `offer` said go: each flush, in the offered order."""
    for data in flushes:
        group.send_bytes(data)


# ---- an engine rank -----------------------------------------------------------------------------
class Receiver:
    """The offered flushes, received one at a time as the decoder asks for them."""

    def __init__(self, group: Group, flushes: list[tuple[str, int]]) -> None:
        self.group, self.flushes, self.received = group, flushes, 0

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        while self.received < len(self.flushes):
            name, size = self.flushes[self.received]
            data = self.group.recv_bytes(size)
            self.received += 1
            yield name, data

    def drain(self) -> None:
        """Receive and drop what the decoder did not take, so rank 0's stream ends."""
        for _ in self:
            pass


def answer(group: Group, manifest: dict[str, Any], version: int, max_flush_bytes: int,
           check: Callable[[], T]) -> tuple[Receiver, T]:
    """Wait for rank 0's offer, check it (sizes, then `check()`: parse, lineage, version), answer, and
    wait for the go. Raises what this rank refused with, or `Refused` when another rank refused."""
    group.seq += 1
    seq = group.seq
    got = group.get(f"{seq}/offer")
    try:
        flushes = _check_offer(got, manifest, version, max_flush_bytes)
        checked = check()
    except Exception as exc:  # every refusal is answered, so rank 0 never waits on this rank
        group.put(f"{seq}/answer/{group.rank}", {
            "ok": False, "status": getattr(exc, "http_status", 400), "type": type(exc).__name__,
            "message": str(getattr(exc, "reason", exc)), "file": getattr(exc, "file", None),
            "param": getattr(exc, "param", None)})
        raise
    group.put(f"{seq}/answer/{group.rank}", {"ok": True})
    go = group.get(f"{seq}/go")
    if not go["go"]:
        raise Refused(go["refusal"])
    return Receiver(group, flushes), checked


def _check_offer(got: dict[str, Any], manifest: dict[str, Any], version: int,
                 max_flush_bytes: int) -> list[tuple[str, int]]:
    if got["manifest_sha256"] != manifest_digest(manifest) or got["version"] != version:
        raise IncompleteDeltaError("the trainer's offer is for another manifest than this request's")
    flushes = [(str(n), int(s)) for n, s in got["flushes"]]
    stated = [(f["name"], int(f["bytes"])) for f in manifest.get("files", [])]
    if flushes != stated:
        raise IncompleteDeltaError(f"the offer lists {len(flushes)} flushes, not the manifest's {len(stated)}")
    for name, size in flushes:
        if size > max_flush_bytes:
            raise LimitError(f"flush of {size} B exceeds this engine's {max_flush_bytes} B per-flush cap", file=name)
    return flushes
