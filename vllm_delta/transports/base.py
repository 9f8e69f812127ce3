"""What one delta put on the wire, for any transport.

Flushes are built by `vllm_delta.wire.FlushBuilder`, whose encoded bytes go to a callback (a
background file writer, or a spool for a broadcast), so encoding the next flush overlaps moving
the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_delta.wire import Manifest


@dataclass
class SentDelta:
    """What one delta (a version, for one group of engines) put on the wire."""

    kind: str  # "delta" | "catchup" | "anchor"
    manifest: Manifest
    flushes: int
    wire_bytes: int  # encoded bytes (after compression)
    pre_compress_bytes: int  # the same flushes before compression
    encode_s: float = 0.0
    location: str | None = None  # version directory (disk)
    spool: Any = None  # the encoded flushes, for a collective (transports.spool.FlushSpool)
