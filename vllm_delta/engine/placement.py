"""Where each checkpoint element lives on this rank, learned from the model's own weight loaders.

Why: writing a changed element straight into the parameter slot that holds it is O(changed);
replaying `load_weights` over a full-shape staged tensor is O(model). Rather than hand-written
per-model tables, we run `model.load_weights` once per checkpoint tensor with a probe tensor
whose values are the element ids (float64, exact up to 2**53) under a thread-local
TorchFunctionMode that records, instead of performing, every write into a parameter. Each
record is a strided destination view plus the ids that would land there. When the ids form an
affine lattice (what TP slicing, qkv / gate_up packing and fused-MoE expert slots produce), the
record becomes a compact `Segment`. Anything else makes the tensor fall back to vLLM's loader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# Probe ids are float64, and the second probe adds numel: exact up to 2**52 elements.
_MAX_PROBE_ELEMENTS = 1 << 52


class UnmappableLoader(Exception):
    """The loader's writes for a tensor are not an exact affine copy of the checkpoint."""


@dataclass(frozen=True)
class Segment:
    """An affine block of one checkpoint tensor copied into one destination tensor.

    Checkpoint flat id = src_offset + sum(i[d] * src_strides[d]); it lands at storage offset
    dst_offset + sum(i[d] * dst_strides[d]) of `target`, for 0 <= i[d] < sizes[d]. Dims are
    ordered by decreasing src stride, which `locate` relies on to invert ids uniquely.
    """

    target: str
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def src_last(self) -> int:
        return self.src_offset + sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides))

    @property
    def src_dense(self) -> bool:
        """Whether the segment holds every id from src_offset to src_last (row-major, no gaps)."""
        expected = 1
        for n, s in reversed(list(zip(self.sizes, self.src_strides))):
            if n == 1:
                continue
            if s != expected:
                return False
            expected *= n
        return True

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For sorted int64 checkpoint positions: (indices into `positions` this segment owns,
        their destination storage offsets)."""
        lo = int(torch.searchsorted(positions, self.src_offset))
        hi = int(torch.searchsorted(positions, self.src_last, right=True))
        if lo >= hi:
            empty = positions.new_empty(0)
            return empty, empty
        window = positions[lo:hi]
        if self.src_dense:
            # Every id from src_offset to src_last is in the segment: no ownership mask needed.
            idx = torch.arange(lo, hi, dtype=positions.dtype, device=positions.device)
            if self.dst_strides == self.src_strides:
                return idx, window + (self.dst_offset - self.src_offset)
            rest = window - self.src_offset
            dst = torch.full_like(window, self.dst_offset)
            for n, s_src, s_dst in zip(self.sizes, self.src_strides, self.dst_strides):
                if n == 1:
                    continue
                i = torch.div(rest, s_src, rounding_mode="floor")
                rest -= i * s_src
                dst += i * s_dst
            return idx, dst
        rest = window - self.src_offset
        dst = torch.full_like(window, self.dst_offset)
        owned = torch.ones_like(window, dtype=torch.bool)
        for n, s_src, s_dst in zip(self.sizes, self.src_strides, self.dst_strides):
            if s_src == 0:
                continue
            i = torch.div(rest, s_src, rounding_mode="floor")
            owned &= i < n
            rest -= i * s_src
            dst += i * s_dst
        owned &= rest == 0
        idx = torch.nonzero(owned).squeeze(1) + lo
        return idx, dst[owned]


@dataclass
class TensorPlacement:
    """All destinations of one checkpoint tensor on this rank (empty: this rank holds none of it)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)
    fallback_reason: str | None = None

    def whole_target(self) -> tuple[str, list[Segment]] | None:
        """A destination holding every element, with its segments (so the tensor can be rebuilt here)."""
        numel = torch.Size(self.shape).numel()
        by_target: dict[str, list[Segment]] = {}
        for seg in self.segments:
            by_target.setdefault(seg.target, []).append(seg)
        return next(((t, segs) for t, segs in by_target.items() if sum(s.numel for s in segs) == numel), None)

    @property
    def covers_whole_tensor(self) -> bool:
        return self.whole_target() is not None


@dataclass(frozen=True)
class _Write:
    target: str
    dst: torch.Tensor
    ids: torch.Tensor


class _RecordParamWrites(TorchFunctionMode):
    """Record (and skip) copies into parameter storage; flag any other in-place write to it."""

    def __init__(self, storages: Mapping[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.writes: list[_Write] = []
        self.foreign: list[str] = []

    def _target(self, t: object) -> str | None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        return self.storages.get(t.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self._target(args[0]) if args else None
        if target is None:
            return func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            self.writes.append(_Write(target, args[0], torch.as_tensor(args[1]).detach()))
            return args[0]
        if func is torch.Tensor.__setitem__:
            view = args[0][args[1]]  # the mode is inactive inside its own handler
            self.writes.append(_Write(target, view, torch.as_tensor(args[2]).detach()))
            return None
        name = getattr(func, "__name__", str(func))
        if name.endswith("_") and not name.startswith("__"):
            self.foreign.append(f"{name} on {target}")  # recorded, never performed
            return args[0]
        return func(*args, **kwargs)


def _affine_fit(ids: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Offset and per-dim strides such that ids == offset + sum(i[d] * stride[d]), or raise."""
    if ids.numel() == 0:
        raise UnmappableLoader("empty write")
    first = ids.reshape(-1)[0]
    offset = float(first)
    strides = []
    expected = torch.full(ids.shape, offset, dtype=torch.float64)
    for d, n in enumerate(ids.shape):
        if n == 1:
            strides.append(0)
            continue
        index = [0] * ids.dim()
        index[d] = 1
        stride = float(ids[tuple(index)]) - offset
        strides.append(stride)
        shape = [1] * ids.dim()
        shape[d] = n
        expected = expected + (torch.arange(n, dtype=torch.float64) * stride).reshape(shape)
    if not torch.equal(expected, ids.to(torch.float64)):
        raise UnmappableLoader("written values are not an affine view of the checkpoint tensor")
    if offset != int(offset) or any(s != int(s) for s in strides):
        raise UnmappableLoader("written values are not integral element ids")
    return int(offset), tuple(int(s) for s in strides)


def _segment(write: _Write, numel: int) -> Segment:
    dst = write.dst
    ids = write.ids.broadcast_to(dst.shape)
    src_offset, src_strides = _affine_fit(ids)
    dims = [d for d in range(dst.dim()) if dst.shape[d] > 1]
    if any(src_strides[d] <= 0 for d in dims):
        raise UnmappableLoader("loader repeats or reverses checkpoint elements")
    dims.sort(key=lambda d: src_strides[d], reverse=True)
    sizes = tuple(dst.shape[d] for d in dims)
    s_src = tuple(src_strides[d] for d in dims)
    s_dst = tuple(dst.stride()[d] for d in dims)
    # Unique inversion needs each stride to exceed the span of all smaller ones.
    span = 0
    for n, s in reversed(list(zip(sizes, s_src))):
        if s <= span:
            raise UnmappableLoader("overlapping source strides")
        span += (n - 1) * s
    seg = Segment(write.target, sizes, src_offset, s_src, dst.storage_offset(), s_dst)
    if src_offset < 0 or seg.src_last >= numel:
        raise UnmappableLoader("loader wrote ids outside the checkpoint tensor")
    return seg


def _record(load_weights, storages: Mapping[int, str], name: str, shape: tuple[int, ...],
            numel: int, shift: int) -> list[_Write]:
    probe = torch.arange(shift, shift + numel, dtype=torch.float64).reshape(shape)
    mode = _RecordParamWrites(storages)
    with torch.no_grad(), mode:
        load_weights([(name, probe)])
    if mode.foreign:
        raise UnmappableLoader("loader writes parameters in place: " + ", ".join(mode.foreign[:3]))
    for w in mode.writes:
        if w.ids.dtype != torch.float64:
            raise UnmappableLoader(f"loader converted the probe to {w.ids.dtype}")
    return mode.writes


def probe_tensor(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    storages: Mapping[int, str],
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> TensorPlacement:
    """Learn the placement of one checkpoint tensor by replaying its loader on element ids."""
    placement = TensorPlacement(name, tuple(shape), dtype)
    numel = 1
    for s in shape:
        numel *= s
    if numel > _MAX_PROBE_ELEMENTS:
        placement.fallback_reason = "tensor too large to probe exactly"
        return placement
    try:
        writes = _record(load_weights, storages, name, shape, numel, shift=0)
        # A second probe with every id shifted by numel tells a copy (which shifts too) from
        # arithmetic that happens to look affine, such as `w.narrow(...) * 2`.
        shifted = _record(load_weights, storages, name, shape, numel, shift=numel)
        if len(writes) != len(shifted) or any(
            a.target != b.target or a.dst.storage_offset() != b.dst.storage_offset()
            or not torch.equal(b.ids.broadcast_to(b.dst.shape) - numel, a.ids.broadcast_to(a.dst.shape))
            for a, b in zip(writes, shifted)
        ):
            raise UnmappableLoader("loader transforms values instead of copying them")
        placement.segments = [_segment(w, numel) for w in writes]
    except UnmappableLoader as exc:
        placement.segments = []
        placement.fallback_reason = str(exc)
    except Exception as exc:  # a loader that rejects the probe cannot be mapped exactly
        placement.segments = []
        placement.fallback_reason = f"loader failed on the probe: {type(exc).__name__}: {exc}"
    return placement


class PeakRss:
    """Extra resident memory at the peak of a block (Linux: the kernel's high-water mark, reset first).

    Why RSS: the probe's temporaries are CPU tensors, which no torch allocator statistic covers.
    `extra` stays None where /proc does not allow the reset.
    """

    extra: int | None = None

    @staticmethod
    def _kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._base = self._kib("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc) -> None:
        if self._base is not None:
            self.extra = max(0, self._kib("VmHWM") - self._base) << 10


def build_placement(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    storages: Mapping[int, str],
    checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, TensorPlacement]:
    """Probe every checkpoint tensor once; log the ones that fall back to vLLM's loader."""
    placements = {
        name: probe_tensor(load_weights, storages, name, shape, dtype)
        for name, (shape, dtype) in checkpoint.items()
    }
    fallbacks = {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}
    if fallbacks:
        logger.warning("delta updates: %d tensors fall back to vLLM's loader: %s", len(fallbacks), fallbacks)
    return placements
