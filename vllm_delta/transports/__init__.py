"""How encoded flushes reach the engines: `disk` (files in a version directory, then one HTTP push
per engine) or `collective` (torch.distributed broadcast of the same bytes, manifest over HTTP).

Both take flushes from `vllm_delta.wire.FlushBuilder`, so the bytes per flush are identical whatever carries them.
"""

from .base import SentDelta

__all__ = ["SentDelta"]
