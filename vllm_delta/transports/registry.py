"""Transports by name, imported only when one is created (as vLLM's weight-transfer `factory.py`).

Why lazy: the s3 transport needs boto3 and the collective one torch.distributed and vLLM's groups;
a sender that writes to disk should import neither.
"""

from __future__ import annotations

import importlib

from vllm_delta.transports.base import Transport, TransportOptions

_REGISTRY: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, class_name: str) -> None:
    """Make `module.class_name` (a `Transport`) the transport called `name`."""
    if name in _REGISTRY:
        raise ValueError(f"transport {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create(name: str, options: TransportOptions) -> Transport:
    """The transport `name`, built from `options`; ValueError for an unknown name or unfit options."""
    if name not in _REGISTRY:
        raise ValueError(f"transport must be one of {names()}, not {name!r}")
    module, class_name = _REGISTRY[name]
    cls: type[Transport] = getattr(importlib.import_module(module), class_name)
    return cls(name, options)


register("disk", "vllm_delta.transports.disk", "DiskTransport")
register("s3", "vllm_delta.transports.s3", "S3Transport")
register("gloo", "vllm_delta.transports.collective", "CollectiveTransport")
register("nccl", "vllm_delta.transports.collective", "CollectiveTransport")
