"""Where each checkpoint element lives on this rank, learned from the model's own weight loaders.

Why: writing a changed element straight into the parameter slot that holds it is O(changed);
replaying `load_weights` over a full-shape staged tensor is O(model). Rather than hand-written
per-model tables, we run `model.load_weights` once per checkpoint tensor under a thread-local
TorchDispatchMode (`_ProbeMode`) that records, and never performs, every write into a parameter.
Writes are found from the op schema's alias info (in-place ops, `out=` arguments), not op names.

Two passes per tensor, one tensor at a time:
- fast: the probe is a `meta` tensor (no memory). When the loader only views it (narrow, select,
  transpose, reshape) and `copy_`s the view into a parameter, the view's storage offset and
  strides *are* the map from checkpoint ids to the destination.
- careful, only where the fast pass cannot prove the map: real element ids (int32 when they fit)
  are loaded, and a second pass with the ids XOR-relabelled tells a copy (which commutes with any
  relabelling) from arithmetic that happens to look affine, such as `w * 2` or `w + 1`.

Each map becomes a compact `Segment` when it is an affine lattice (TP slicing, qkv / gate_up
packing, fused-MoE expert slots). Anything else - a write into a parameter that is not a plain
copy, an advanced-index write, a write into live state outside the parameters - makes the
tensor fall back to vLLM's loader, with the reason.

One exception, a `Fill`: vLLM pads the vocab to a multiple of 64 and its embedding loader fills
the padding rows with a constant. A fill with a scalar (the same in the careful pass's two runs,
so not derived from the checkpoint) is allowed where no segment of any checkpoint tensor reaches
the filled elements (`_refuse_overlapping_fills`, once every tensor is probed): those elements
are no checkpoint element, a delta never changes them, and they keep what vLLM's load put there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

# The careful pass's ids: int32 while every relabelled id fits, else int64.
_INT32_IDS = 1 << 30
_RELABEL = {torch.int32: 0x2AAAAAAA, torch.int64: 0x2AAAAAAAAAAAAAAA}
# Rows compared at a time by the careful pass (bounds its int64 temporaries).
_FIT_BLOCK = 1 << 20


class UnmappableLoader(Exception):
    """The loader's writes for a tensor are not an exact affine copy of the checkpoint."""


class _NotDirect(Exception):
    """The fast pass cannot prove the map from views alone (the careful pass decides)."""


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


@dataclass(frozen=True)
class Fill:
    """A loader's fill of a destination region with a constant: storage offset dst_offset +
    sum(i[d] * dst_strides[d]) of `target`, for 0 <= i[d] < sizes[d], all set to `value`."""

    target: str
    sizes: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    value: bool | int | float
    op: str  # the aten op, for the reason where the fill is refused


@dataclass
class TensorPlacement:
    """All destinations of one checkpoint tensor on this rank (empty: this rank holds none of it)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)
    fallback_reason: str | None = None
    # Whether the loader read the tensor at all on this rank (False: it skips it here, e.g. an
    # expert another EP rank holds, or a tensor vLLM ignores such as rotary `inv_freq`).
    read: bool = True
    # Constant fills of elements no checkpoint element reaches (vLLM's vocab padding rows).
    fills: list[Fill] = field(default_factory=list)

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
    target: str  # the parameter written
    dst: torch.Tensor  # the destination view of its storage
    src: torch.Tensor  # what the loader copied there


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """Tensors the op writes, from its schema's alias info (in-place `self`, `out=` and the like)."""
    writes = _WRITES.get(func)
    if writes is None:  # the schema's written arguments, looked up once per op
        writes = _WRITES[func] = tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                                       if arg.alias_info is not None and arg.alias_info.is_write)
    out = []
    for i, name in writes:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def _tensors(args: tuple, kwargs: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (aten arguments nest at most one list deep)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


def _fresh_outputs(func: Any, result: Any) -> list[torch.Tensor]:
    """Outputs the op allocated (no alias info on the return): scratch the loader may write."""
    returns = func._schema.returns
    results = result if isinstance(result, (tuple, list)) and len(returns) > 1 else (result,)
    fresh = []
    for ret, value in zip(returns, results):
        if ret.alias_info is None or func is torch.ops.aten.lift_fresh.default:
            fresh.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return fresh


class _ProbeMode(TorchDispatchMode):
    """Run the loader, performing no write into any storage that existed before it started
    except the probe's own; record `copy_`s into parameters, refuse every other such write."""

    def __init__(self, storages: Mapping[int, str], probe: torch.Tensor) -> None:
        super().__init__()
        self.storages = storages
        self.probe = probe.untyped_storage()._cdata
        self.scratch: set[int] = set()  # storages the loader allocated while probing
        self.writes: list[_Write] = []
        self.fills: list[Fill] = []
        self.refused: list[str] = []
        self.read = False  # the loader touched the probe
        self.probe_written = False  # ... and wrote into it (its views no longer hold the ids)

    def is_probe(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata == self.probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.read = self.read or any(self.is_probe(t) for t in tensors)
        blocked = False
        for w in _written(func, args, kwargs):
            if self.is_probe(w):
                self.probe_written = True
                continue
            storage = w.untyped_storage()
            if w.numel() == 0 or storage._cdata in self.scratch:
                continue  # writes nothing (e.g. vLLM's fill of an empty vocab pad), or the loader's own
            blocked = True
            target = self.storages.get(storage_key(w))
            if target is None:
                self.refused.append(f"{func} writes a tensor that is neither a parameter nor the loader's own")
            elif func is torch.ops.aten.copy_.default:
                self.writes.append(_Write(target, w, args[1]))
            elif (value := _fill_value(func, args)) is not None:
                self.fills.append(Fill(target, tuple(w.shape), w.storage_offset(), tuple(w.stride()), value, str(func)))
            else:
                self.refused.append(f"{func} writes parameter {target}")
        if blocked:  # not performed; hand back what the op would have returned
            written = _written(func, args, kwargs)
            return written[0] if len(func._schema.returns) <= 1 else tuple(written)
        result = func(*args, **kwargs)
        self.scratch.update(t.untyped_storage()._cdata for t in _fresh_outputs(func, result))
        return result


def _fill_value(func: Any, args: tuple) -> bool | int | float | None:
    """The scalar an op fills its destination with, or None when it is not a fill with a scalar
    (a fill with a tensor may carry checkpoint values: refused like any other write)."""
    if func is torch.ops.aten.zero_.default:
        return 0
    if func is torch.ops.aten.fill_.Scalar and type(args[1]) in (bool, int, float):
        return args[1]
    return None


def storage_key(t: torch.Tensor) -> int:
    """The key of a parameter's storage in the probe's `storages` map.

    Why two kinds: meta tensors (the full-shape harness) have no data pointer, so they are keyed by
    their storage object, negated so it never meets a real address.
    """
    storage = t.untyped_storage()
    return -storage._cdata if t.device.type == "meta" else storage.data_ptr()


def storages_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """`storages` for the probe from (name, parameter) pairs (the first name of a shared storage wins)."""
    out: dict[int, str] = {}
    for name, t in named:
        if t.numel() > 0:
            out.setdefault(storage_key(t), name)
    return out


def _segment(target: str, dst: torch.Tensor, src_offset: int, src_strides: tuple[int, ...],
             numel: int) -> Segment:
    """The segment for `dst` receiving ids src_offset + sum(i[d] * src_strides[d]), or raise."""
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
    seg = Segment(target, sizes, src_offset, s_src, dst.storage_offset(), s_dst)
    if src_offset < 0 or seg.src_last >= numel:
        raise UnmappableLoader("loader wrote ids outside the checkpoint tensor")
    return seg


def _run(load_weights, storages: Mapping[int, str], name: str, probe: torch.Tensor) -> _ProbeMode:
    mode = _ProbeMode(storages, probe)
    with torch.no_grad(), mode:
        load_weights([(name, probe)])
    if mode.refused:
        raise UnmappableLoader("loader writes outside a plain copy: " + "; ".join(sorted(set(mode.refused))[:3]))
    return mode


def _fast(load_weights, storages: Mapping[int, str], name: str, shape: tuple[int, ...],
          dtype: torch.dtype, numel: int, fills: list[Fill] | None = None) -> tuple[list[Segment], bool]:
    """Segments from the views the loader copied, on a meta probe; _NotDirect where unproven.
    The loader's constant fills are added to `fills`."""
    probe = torch.empty(shape, dtype=dtype, device="meta")
    try:
        mode = _run(load_weights, storages, name, probe)
    except UnmappableLoader:
        raise
    except Exception as exc:  # e.g. the loader reads values (`.item()`), which meta has none of
        raise _NotDirect(f"{type(exc).__name__}: {exc}") from exc
    if mode.probe_written:
        raise _NotDirect("loader writes into the checkpoint tensor")
    segments = []
    for w in mode.writes:
        src = w.src
        if not (isinstance(src, torch.Tensor) and mode.is_probe(src) and src.dtype == dtype
                and not src.is_neg() and not src.is_conj()):
            raise _NotDirect("a write is not a view of the checkpoint tensor")
        src = src.expand(w.dst.shape)
        segments.append(_segment(w.target, w.dst, src.storage_offset(), tuple(src.stride()), numel))
    if fills is not None:
        fills.extend(mode.fills)
    return segments, mode.read


def _ids_of(src: Any, dst: torch.Tensor, id_dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(src, torch.Tensor):
        raise UnmappableLoader("loader writes a constant")
    if src.dtype != id_dtype:
        raise UnmappableLoader(f"loader converted the probe to {src.dtype}")
    return src.broadcast_to(dst.shape)


def _affine_fit(ids: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Offset and per-dim strides such that ids == offset + sum(i[d] * stride[d]), or raise.

    Compared a block of leading rows at a time, so temporaries stay bounded.
    """
    if ids.numel() == 0:
        raise UnmappableLoader("empty write")
    if ids.dim() == 0:
        return int(ids), ()
    offset = int(ids.reshape(-1)[0])
    strides = []
    for d, n in enumerate(ids.shape):
        index = [0] * ids.dim()
        index[d] = 1
        strides.append(int(ids[tuple(index)]) - offset if n > 1 else 0)
    inner = ids[0].numel()
    rows = max(1, _FIT_BLOCK // max(inner, 1))
    lattice = None
    if ids.dim() > 1:
        lattice = torch.zeros((), dtype=torch.int64, device=ids.device)
        for d in range(1, ids.dim()):
            lattice = lattice.unsqueeze(-1) + torch.arange(ids.shape[d], device=ids.device) * strides[d]
    for r0 in range(0, ids.shape[0], rows):
        r = torch.arange(r0, min(r0 + rows, ids.shape[0]), device=ids.device) * strides[0] + offset
        expected = r if lattice is None else r.reshape(-1, *([1] * (ids.dim() - 1))) + lattice
        if not torch.equal(expected, ids[r0:r0 + rows].to(torch.int64)):
            raise UnmappableLoader("written values are not an affine view of the checkpoint tensor")
    return offset, tuple(strides)


def _careful(load_weights, storages: Mapping[int, str], name: str, shape: tuple[int, ...],
             numel: int, fills: list[Fill] | None = None) -> tuple[list[Segment], bool]:
    """Segments from element ids the loader copied, checked against a relabelled second pass.
    The loader's constant fills (the same in both passes) are added to `fills`."""
    id_dtype = torch.int32 if numel <= _INT32_IDS else torch.int64
    ids = torch.arange(numel, dtype=id_dtype).reshape(shape)
    mode = _run(load_weights, storages, name, ids)
    segments = [_segment(w.target, w.dst, *_affine_fit(_ids_of(w.src, w.dst, id_dtype)), numel)
                for w in mode.writes]
    read, filled = mode.read, mode.fills
    del mode
    # A copy commutes with relabelling the ids; `w * 2`, `w + 1` or a sort does not.
    ids.bitwise_xor_(_RELABEL[id_dtype])
    relabelled = _run(load_weights, storages, name, ids)
    if len(relabelled.writes) != len(segments):
        raise UnmappableLoader("loader transforms values instead of copying them")
    if relabelled.fills != filled:
        raise UnmappableLoader("loader fills a parameter with values that follow the checkpoint tensor")
    for seg, w in zip(segments, relabelled.writes):
        got = _ids_of(w.src, w.dst, id_dtype)
        want = torch.as_strided(ids.reshape(-1), got.shape, _src_strides_of(seg, w.dst), seg.src_offset)
        # The loader may have moved the ids to the parameter's device: compare there.
        if w.target != seg.target or w.dst.storage_offset() != seg.dst_offset or not torch.equal(
                got, want.to(got.device)):
            raise UnmappableLoader("loader transforms values instead of copying them")
    if fills is not None:
        fills.extend(filled)
    return segments, read


def _src_strides_of(seg: Segment, dst: torch.Tensor) -> tuple[int, ...]:
    """The segment's source strides in `dst`'s own dim order (0 where a dim has one element)."""
    by_dst = {s_dst: s_src for s_dst, s_src in zip(seg.dst_strides, seg.src_strides)}
    return tuple(by_dst.get(st, 0) if n > 1 else 0 for n, st in zip(dst.shape, dst.stride()))


def probe_tensor(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    storages: Mapping[int, str],
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> TensorPlacement:
    """Learn the placement of one checkpoint tensor by replaying its loader on a probe."""
    placement = TensorPlacement(name, tuple(shape), dtype)
    numel = torch.Size(shape).numel()
    try:
        try:
            placement.segments, placement.read = _fast(load_weights, storages, name, tuple(shape), dtype, numel,
                                                       placement.fills)
        except _NotDirect as why:
            logger.debug("delta updates: %s needs the careful probe (%s)", name, why)
            placement.segments, placement.read = _careful(load_weights, storages, name, tuple(shape), numel,
                                                          placement.fills)
    except UnmappableLoader as exc:
        placement.segments, placement.fills = [], []
        placement.fallback_reason = str(exc)
    except Exception as exc:  # a loader that rejects the probe cannot be mapped exactly
        placement.segments, placement.fills = [], []
        placement.fallback_reason = f"loader failed on the probe: {type(exc).__name__}: {exc}"
    return placement


def _runs(offset: int, sizes: Iterable[int], strides: Iterable[int], limit: int = 1 << 22) -> torch.Tensor | None:
    """The storage offsets of a strided region as sorted [start, end) runs (k x 2), or None past `limit` runs."""
    dims = sorted(((n, s) for n, s in zip(sizes, strides) if n > 1), key=lambda d: -d[1])
    run = 1
    while dims and dims[-1][1] == run:  # trailing dims contiguous in storage make one run
        run *= dims.pop()[0]
    count = 1
    for n, _ in dims:
        count *= n
    if count > limit:
        return None
    starts = torch.tensor(offset, dtype=torch.int64)
    for n, s in dims:
        starts = starts.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    starts = torch.sort(starts.reshape(-1)).values
    return torch.stack([starts, starts + run], dim=1)


def _reached(runs: list[torch.Tensor], region: torch.Tensor) -> bool:
    """Whether any [start, end) run of `region` meets any of `runs`."""
    if not runs:
        return False
    held = torch.cat(runs)
    held = held[torch.argsort(held[:, 0])]
    ends = torch.cummax(held[:, 1], 0).values  # the furthest end among the runs starting so far
    last = torch.searchsorted(held[:, 0].contiguous(), region[:, 1].contiguous()) - 1  # last run starting before each end
    return bool(((last >= 0) & (ends[last.clamp(min=0)] > region[:, 0])).any())


def _refuse_overlapping_fills(placements: Mapping[str, TensorPlacement]) -> None:
    """Turn into a fallback (refused, as any in-place write is) each tensor whose loader fills
    elements that a segment of any checkpoint tensor reaches: only padding may be filled.

    Why after every tensor is probed: a fill can meet another tensor's rows (a packed qkv's), and
    only the whole map says which elements checkpoint elements reach. Startup only, and only for
    the destinations filled (an embedding, an lm_head).
    """
    filled = {f.target for p in placements.values() for f in p.fills}
    if not filled:
        return
    held: dict[str, list[torch.Tensor | None]] = {t: [] for t in filled}
    for p in placements.values():
        for seg in p.segments:
            if seg.target in held:
                held[seg.target].append(_runs(seg.dst_offset, seg.sizes, seg.dst_strides))
    for p in placements.values():
        for fill in p.fills:
            region = _runs(fill.dst_offset, fill.sizes, fill.dst_strides)
            runs = held[fill.target]
            if region is None or any(r is None for r in runs):
                why = "too fragmented to check against the checkpoint's elements"
            elif _reached(runs, region):
                why = "elements that checkpoint elements reach"
            else:
                continue
            p.segments, p.fills = [], []
            p.fallback_reason = f"loader writes outside a plain copy: {fill.op} writes parameter {fill.target} ({why})"
            break


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


class _BatchMode(TorchDispatchMode):
    """`_ProbeMode` for many meta probes fed to one `load_weights` call: a write is attributed to
    the checkpoint tensor whose probe it copies (by storage identity, not by loader order).

    Anything `_fast` would not prove - a write into a probe, a write that is not a `copy_` of a
    probe's view, a write outside the parameters - marks the batch `rejected` at `current` (the
    index of the tensor last handed to the loader), and the caller re-probes those tensors.
    """

    def __init__(self, storages: Mapping[int, str], probes: Mapping[int, int],
                 dtypes: list[torch.dtype]) -> None:
        super().__init__()
        self.storages, self.probes, self.dtypes = storages, probes, dtypes
        self.scratch: set[int] = set()
        self.writes: dict[int, list[_Write]] = {}
        self.read: set[int] = set()
        self.current = 0
        self.rejected: int | None = None

    def _reject(self) -> None:
        if self.rejected is None:
            self.rejected = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors(args, kwargs):
            if (i := self.probes.get(t.untyped_storage()._cdata)) is not None:
                self.read.add(i)
        blocked = False
        for w in _written(func, args, kwargs):
            cdata = w.untyped_storage()._cdata
            if cdata in self.probes:
                self._reject()
                continue
            if w.numel() == 0 or cdata in self.scratch:
                continue
            blocked = True
            target = self.storages.get(storage_key(w))
            src = args[1] if func is torch.ops.aten.copy_.default else None
            owner = self.probes.get(src.untyped_storage()._cdata) if isinstance(src, torch.Tensor) else None
            if (target is None or owner is None or src.dtype != self.dtypes[owner]
                    or src.is_neg() or src.is_conj()):
                self._reject()
            else:
                self.writes.setdefault(owner, []).append(_Write(target, w, src))
        if blocked:
            written = _written(func, args, kwargs)
            return written[0] if len(func._schema.returns) <= 1 else tuple(written)
        result = func(*args, **kwargs)
        self.scratch.update(t.untyped_storage()._cdata for t in _fresh_outputs(func, result))
        return result


def _probe_batch(load_weights, storages: Mapping[int, str],
                 items: list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]
                 ) -> tuple[dict[str, TensorPlacement] | None, int]:
    """Placements of `items` from one `load_weights` call on meta probes, or (None, index of the
    tensor the loader was at when the batch stopped being provable)."""
    probes = [torch.empty(shape, dtype=dtype, device="meta") for _, (shape, dtype) in items]
    mode = _BatchMode(storages, {p.untyped_storage()._cdata: i for i, p in enumerate(probes)},
                      [dtype for _, (_, dtype) in items])

    def feed():
        for i, ((name, _), probe) in enumerate(zip(items, probes)):
            mode.current = i
            yield name, probe

    try:
        with torch.no_grad(), mode:
            load_weights(feed())
    except Exception:  # e.g. a loader that reads values; per tensor, the careful pass decides
        mode._reject()
    if mode.rejected is not None:
        return None, mode.rejected
    out = {}
    for i, (name, (shape, dtype)) in enumerate(items):
        numel = torch.Size(shape).numel()
        placement = TensorPlacement(name, tuple(shape), dtype, read=i in mode.read)
        try:
            for w in mode.writes.get(i, ()):
                src = w.src.expand(w.dst.shape)
                placement.segments.append(_segment(w.target, w.dst, src.storage_offset(), tuple(src.stride()), numel))
        except UnmappableLoader:
            return None, i
        out[name] = placement
    return out, 0


def build_placement(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    storages: Mapping[int, str],
    checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    batch: int = 1024,
) -> dict[str, TensorPlacement]:
    """Probe every checkpoint tensor once; log the ones that fall back to vLLM's loader.

    Why batches: one `load_weights` call per tensor pays the loader's per-call setup (vLLM builds
    `dict(named_parameters())` and walks its expert mapping) 46k times at 355B. A batch of meta
    probes goes through one call; a batch that `_BatchMode` cannot prove is split around the
    tensor it stopped at, down to `probe_tensor` alone, which decides exactly as it always did.
    """
    items = list(checkpoint.items())
    found: dict[str, TensorPlacement] = {}
    pending = [(0, len(items))] if batch > 1 else [(i, i + 1) for i in range(len(items))]
    while pending:
        lo, hi = pending.pop()
        if hi - lo == 1:
            name, (shape, dtype) = items[lo]
            found[name] = probe_tensor(load_weights, storages, name, shape, dtype)
            continue
        if hi - lo > batch:
            mid = lo + batch
            pending += [(mid, hi), (lo, mid)]
            continue
        result, bad = _probe_batch(load_weights, storages, items[lo:hi])
        if result is not None:
            found.update(result)
            continue
        k = lo + bad  # the rest of the batch is probed again, the tensor at fault alone
        pending += [r for r in [(k + 1, hi), (k, k + 1), (lo, k)] if r[1] > r[0]]
    placements = {name: found[name] for name, _ in items}
    _refuse_overlapping_fills(placements)
    fallbacks = {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}
    if fallbacks:
        logger.warning("delta updates: %d tensors fall back to vLLM's loader: %s", len(fallbacks), fallbacks)
    return placements
