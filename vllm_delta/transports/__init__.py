"""How encoded flushes reach the engines: one module per transport, each a `base.Transport` created by
name through `registry.py`, holding its sender half and its engine-receive half (docs/architecture.md)."""

from vllm_delta.transports.base import SentDelta, Transport, TransportOptions

__all__ = ["SentDelta", "Transport", "TransportOptions"]
