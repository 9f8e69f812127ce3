"""Which live weight each segment views, checked every sync (a `data_ptr` compare per weight, no device sync).

Why: a trainer that rebinds `param.data` (CPU offload, re-wrapping) leaves a segment's view on a dead
copy: no change is seen and the served weights freeze. A weight that moved with its layout intact
gets its views re-derived at the same offsets; anything else raises, naming the weight.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_hook.hf_map import local_tensors
from vllm_delta.sender.shards import Segments


class RebindError(RuntimeError):
    """A weight was rebound after `register()` in a way its segment views cannot follow."""


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


@dataclass
class _Weight:
    name: str  # the Megatron name, for messages
    module: torch.nn.Module
    attr: str
    ptr: int
    layout: tuple
    views: list[tuple[int, int]] = field(default_factory=list)  # (segment index, element offset from ptr)


class Bindings:
    """The weights behind `segments` (views of `chunks`' local tensors, as `chunk_segments` makes them)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], segments: Sequence[Segments]) -> None:
        self.weights: list[_Weight] = []
        for i, gpt in enumerate(chunks):
            for name, t in local_tensors(gpt).items():
                mod, _, attr = name.rpartition(".")
                label = name if len(chunks) == 1 else f"chunk {i}: {name}"
                self.weights.append(_Weight(label, gpt.get_submodule(mod), attr, t.data_ptr(), _layout(t)))
        by_ptr = sorted(range(len(self.weights)), key=lambda k: self.weights[k].ptr)
        starts = [self.weights[k].ptr for k in by_ptr]
        for si, s in enumerate(segments):
            w = self._owner(s, by_ptr, starts)
            w.views.append((si, (s.tensor.data_ptr() - w.ptr) // s.tensor.element_size()))
        self.weights = [w for w in self.weights if w.views]

    def _owner(self, s: Segments, by_ptr: list[int], starts: list[int]) -> _Weight:
        """The weight whose bytes hold all of `s.tensor` (a segment over a copy has none: refused)."""
        t = s.tensor
        first = t.data_ptr()
        last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
        k = bisect.bisect_right(starts, first) - 1
        if k >= 0:
            w = self.weights[by_ptr[k]]
            shape, _, dtype, _ = w.layout
            end = w.ptr + torch.Size(shape).numel() * dtype.itemsize
            if last < end and t.dtype == dtype and t.device == w.layout[3]:
                return w
        raise RebindError(
            f"{s.name}: its segment is not a view of any model weight, so it would not see training change it"
        )

    def refresh(self, segments: list[Segments]) -> list[str]:
        """Re-point the views of every weight rebound since the last call (in `segments`, in place);
        the names of those weights. Raises `RebindError` for one whose layout changed."""
        moved = []
        for w in self.weights:
            t = getattr(w.module, w.attr)
            if t.data_ptr() == w.ptr and _layout(t) == w.layout:
                continue
            if _layout(t) != w.layout:
                shape, stride, dtype, device = w.layout
                raise RebindError(
                    f"{w.name} was rebound after register(): it was {list(shape)} {dtype} on {device} with "
                    f"strides {stride}, now {list(t.shape)} {t.dtype} on {t.device} with strides "
                    f"{t.stride()}; "
                    "the hook cannot follow it (register again after changing the model's layout)"
                )
            base = t.detach()
            for si, off in w.views:
                old = segments[si].tensor
                segments[si] = segments[si].with_tensor(
                    base.as_strided(old.shape, old.stride(), base.storage_offset() + off)
                )
            w.ptr = t.data_ptr()
            moved.append(w.name)
        return moved
