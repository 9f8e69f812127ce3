"""Transports by name, imported only when one is created (as vLLM's weight-transfer `factory.py`): s3
needs boto3, the collective one torch.distributed and vLLM's groups; a sender writing to disk neither."""

from __future__ import annotations

import importlib

from vllm_delta.transports.base import Transport, TransportOptions

_REGISTRY = {
    "disk": ("vllm_delta.transports.disk", "DiskTransport"),
    "s3": ("vllm_delta.transports.s3", "S3Transport"),
    "gloo": ("vllm_delta.transports.collective", "CollectiveTransport"),
    "nccl": ("vllm_delta.transports.collective", "CollectiveTransport"),
}


def create(name: str, options: TransportOptions) -> Transport:
    """The transport `name`, built from `options`; ValueError for an unknown name or unfit options."""
    if name not in _REGISTRY:
        raise ValueError(f"transport must be one of {tuple(_REGISTRY)}, not {name!r}")
    module, class_name = _REGISTRY[name]
    cls: type[Transport] = getattr(importlib.import_module(module), class_name)
    return cls(name, options)
