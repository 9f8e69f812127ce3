"""Disk transport: flush files in a version directory, written by a background thread, manifest last.

Why this order: each flush is written atomically (`.tmp`, fsync, rename) while the sender encodes
the next one; the manifest is written only after every flush is on disk, so a sender that dies
mid-write leaves a directory without a manifest, which every engine refuses (IncompleteDeltaError).
Multi-rank senders write their own flush files and rank 0 writes the merged manifest.

The engine's half is the wire format's own reader (`wire.open_delta` over a `DeltaDir` opened under
the engine's `--delta-updates-root`): the files are already where the engine reads them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vllm_delta.client import EngineClient, Reply
from vllm_delta.transports.base import SentDelta, Sink, Transport, TransportOptions
from vllm_delta.transports.writer import BackgroundFlushWriter, Throttle, throttled_write
from vllm_delta.wire import MANIFEST_NAME, FlushBuilder, Manifest, write_manifest


def file_writer(directory: Path, throttle: Throttle | None = None) -> BackgroundFlushWriter:
    """Flush files in `directory`, each written atomically (and paced through `throttle`)."""
    return BackgroundFlushWriter(lambda name, data: throttled_write(Path(directory) / name, data, throttle))


def prepare_version_dir(path: Path) -> Path:
    """An empty version directory; a leftover one (e.g. from a sender that died) is replaced."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def seal(path: Path, manifest: Manifest) -> int:
    """Write the manifest last; returns its size in bytes."""
    return write_manifest(path, manifest).stat().st_size


def remove_version_dir(path: Path) -> None:
    """Delete a delivered version directory, manifest first so no reader sees it as finished."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


class DiskTransport(Transport):
    """Flush files under `delta_dir/<version dir>`, one HTTP push per engine naming that directory."""

    stored = True  # every rank writes into the same directory; rank 0 seals it

    def __init__(
        self, delta_dir: Path, *, throttle_bytes_per_s: float | None = None, keep: bool = False
    ) -> None:
        self.delta_dir, self.keep = Path(delta_dir), keep
        self.throttle_bytes_per_s = throttle_bytes_per_s

    @classmethod
    def create(cls, name: str, options: TransportOptions) -> DiskTransport:
        if options.delta_dir is None:
            raise ValueError("the disk transport needs delta_dir")
        return cls(
            Path(options.delta_dir), throttle_bytes_per_s=options.throttle_bytes_per_s, keep=options.keep
        )

    def prepare(self, name: str) -> None:
        """Rank 0, before any rank writes: an empty version directory."""
        prepare_version_dir(self.delta_dir / name)

    def sink(self, name: str, **kwargs) -> Sink:
        throttle = Throttle(self.throttle_bytes_per_s) if self.throttle_bytes_per_s else None
        writer = file_writer(self.delta_dir / name, throttle)
        return Sink(FlushBuilder(writer.emit, **kwargs), str(self.delta_dir / name), writer=writer)

    def seal(self, sent: SentDelta) -> None:
        seal(Path(sent.location), sent.manifest)

    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        return client.update({u: {"path": Path(s.location).name, **body} for u, (s, body) in targets.items()})

    def cleanup(self, sent: list[SentDelta]) -> None:
        if not self.keep:
            for s in sent:
                remove_version_dir(Path(s.location))
