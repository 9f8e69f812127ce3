"""How encoded flushes reach the engines: `disk` (files in a version directory, then one HTTP push
per engine), `s3` (objects in an S3-compatible store, then the same pushes; `store.py` is the
client) or `collective` (torch.distributed broadcast of the same bytes, manifest over HTTP; `groups.py`
builds the groups, `spool.py` holds the sender's flushes).

Each is a `base.Transport`, created by name through `registry.py`, and its module holds both its
sender half and its engine-receive half. All take flushes from `vllm_delta.wire.FlushBuilder`, so
the bytes per flush are identical whatever carries them.
"""

from vllm_delta.transports.base import SentDelta, Transport, TransportOptions

__all__ = ["SentDelta", "Transport", "TransportOptions"]
