"""A fake engine that pulls each pushed version from the test store, for sender-side store tests.

Why: the sender's rules (seal before push, one upload for any number of engines, catch-up from the
store) are checked in-process in seconds against tests/sender's FakeEngine (real HTTP, real wire
decoding, the engines' own lineage rule), which reads a local directory. This one first downloads
the pushed version's objects with a plain boto3 client of its own (not the code under test) into a
directory of its own, so it sees exactly what the store holds when the push arrives.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import torch

from harness.s3_server import S3Server, prefix_of

_SENDER_TESTS = str(Path(__file__).resolve().parents[1] / "sender")
if _SENDER_TESTS not in sys.path:
    sys.path.append(_SENDER_TESTS)

from sender_helpers import FakeEngine, engine_checksums, engine_status  # noqa: E402,F401  (re-exported)


class StoreFakeEngine(FakeEngine):
    """FakeEngine on `workdir`, fed by the store: `fetched_bytes` counts what it downloaded."""

    def __init__(self, server: S3Server, url: str, weights: dict[str, torch.Tensor], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(workdir, weights)
        self.server, self.prefix = server, prefix_of(url)
        self.fetched_bytes = 0

    async def update(self, request):
        body = await request.json()  # aiohttp keeps the body: FakeEngine.update reads it again
        self.fetched_bytes += await asyncio.to_thread(self._download, body["path"])
        return await super().update(request)

    def _download(self, version_dir: str) -> int:
        client, out, n = self.server.client(), self.root / version_dir, 0
        shutil.rmtree(
            out, ignore_errors=True
        )  # a version re-uploaded under the same name: only what is there now
        out.mkdir(parents=True)
        for key in self.server.keys(f"{self.prefix}/{version_dir}/"):
            data = client.get_object(Bucket=self.server.bucket, Key=key)["Body"].read()
            (out / key.rsplit("/", 1)[1]).write_bytes(data)
            n += len(data)
        return n
