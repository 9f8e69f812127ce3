"""How encoded flushes reach the engines: `disk` (files in a version directory, then one HTTP push
per engine), `s3` (objects in an S3-compatible store, then the same pushes; `store.py` is the
client) or `collective` (torch.distributed broadcast of the same bytes, manifest over HTTP).

Both take flushes from `vllm_delta.wire.FlushBuilder`, so the bytes per flush are identical whatever carries them.
"""

from .base import SentDelta

__all__ = ["SentDelta"]
