"""Strong content hashes (xxh3-128): per flush file, and per whole tensor after apply."""

from __future__ import annotations

from typing import Final

import torch
import xxhash

from .dtypes import to_bits

HASH_ALGO: Final = "xxh3_128"


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def tensor_digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bit patterns in row-major order (what `post_hash` holds)."""
    return xxhash.xxh3_128_hexdigest(to_bits(t.detach().cpu().contiguous()).view("u1").data)
