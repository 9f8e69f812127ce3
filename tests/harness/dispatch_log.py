"""The aten ops a block dispatches, counted (`OpCount`) or logged (`OpLog`), for tests that check what ran.

Why: on `meta` a commit produces no values to compare, so what it did is read from its ops:
each one's devices, the scatters' destinations and sizes, and any host<->device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _tensors(tree: object) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


@dataclass(frozen=True, eq=False)
class Op:
    name: str  # e.g. "index_copy_", "_to_copy"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    kwargs: dict

    def devices(self) -> set[str]:
        return {t.device.type for t in self.inputs + self.outputs}


class OpCount(TorchDispatchMode):
    """Counts the aten ops a block dispatches, recording nothing: the proxy for kernel launches."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class OpLog(TorchDispatchMode):
    """Runs every op as it is and records it (tensors kept by reference: read them after the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(Op(func.overloadpacket.__name__, _tensors((args, kwargs)), _tensors(out), kwargs))
        return out

    def named(self, name: str) -> list[Op]:
        return [op for op in self.ops if op.name == name]

    def copies(self, src: str, dst: str) -> list[Op]:
        """Ops that read a tensor on device type `src` and produce one on `dst` (a cross-device copy)."""
        return [
            op
            for op in self.ops
            if any(t.device.type == src for t in op.inputs) and any(t.device.type == dst for t in op.outputs)
        ]

    def host_reads(self) -> list[Op]:
        """`.item()`, `int()`, `bool()` of a device tensor: each waits for the device."""
        return [op for op in self.named("_local_scalar_dense") if op.inputs[0].device.type != "cpu"]
