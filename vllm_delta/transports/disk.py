"""Disk transport: flush files in a version directory, each written atomically by a background thread
while the next is encoded, the merged manifest last (rank 0): a sender that dies mid-write leaves a
directory without one, which every engine refuses. The engine's half is the wire's own reader
(`wire.open_delta` under the engine's `--delta-updates-root`): the files are where it reads them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vllm_delta.client import EngineClient, Reply
from vllm_delta.transports.base import (
    BackgroundFlushWriter,
    SentDelta,
    Sink,
    Throttle,
    Transport,
    TransportOptions,
)
from vllm_delta.wire import MANIFEST_NAME, FlushBuilder, write_manifest
from vllm_delta.wire.manifest import write_atomic


class DiskTransport(Transport):
    """Flush files under `delta_dir/<version dir>`, one HTTP push per engine naming that directory."""

    stored = True  # every rank writes into the same directory; rank 0 seals it

    def __init__(self, name: str, options: TransportOptions) -> None:
        if options.delta_dir is None:
            raise ValueError("the disk transport needs delta_dir")
        self.delta_dir, self.keep = Path(options.delta_dir), options.keep
        self.throttle_bytes_per_s = options.throttle_bytes_per_s

    def prepare(self, name: str) -> None:
        """Rank 0, before any rank writes: an empty version directory (a leftover one, e.g. from a
        sender that died, is replaced)."""
        path = self.delta_dir / name
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)

    def sink(self, name: str, **kwargs) -> Sink:
        path = self.delta_dir / name
        pace = Throttle(self.throttle_bytes_per_s).wait if self.throttle_bytes_per_s else None
        writer = BackgroundFlushWriter(lambda file, data: write_atomic(path / file, data, pace))
        return Sink(FlushBuilder(writer.emit, **kwargs), str(path), writer=writer)

    def seal(self, sent: SentDelta) -> None:
        write_manifest(Path(sent.location), sent.manifest)

    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        return client.update({u: {"path": Path(s.location).name, **body} for u, (s, body) in targets.items()})

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Delete the delivered version directories, manifest first so no reader sees one as finished."""
        if not self.keep:
            for s in sent:
                (Path(s.location) / MANIFEST_NAME).unlink(missing_ok=True)
                shutil.rmtree(s.location, ignore_errors=True)
