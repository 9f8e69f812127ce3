"""Learning placements: where each checkpoint element lives on this rank, from the model's own loaders.

Why: writing a changed element into its slot is O(changed), replaying `load_weights` O(model). Each
tensor's loader runs once under the sealed interception (`intercept.Intercept`): on a `meta` probe a
`copy_` of a view maps ids by the view's offset and strides; where that proves nothing, real ids and
then XOR-relabelled ids tell a copy from arithmetic. Affine maps become `Segment`s, anything else a
fallback with its reason; a scalar `Fill` only where no checkpoint element reaches it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from vllm_delta.engine.intercept import Intercept, Write, storage_key
from vllm_delta.engine.placement import Fill, Segment, TensorPlacement, refuse_overlapping_fills

logger = logging.getLogger(__name__)

_INT32_IDS = 1 << 30  # the careful pass's ids: int32 while every relabelled id fits
_RELABEL = {torch.int32: 0x2AAAAAAA, torch.int64: 0x2AAAAAAAAAAAAAAA}
# Rows compared at a time by the careful pass (bounds its int64 temporaries).
_FIT_BLOCK = 1 << 20


class UnmappableLoader(Exception):
    """The loader's writes for a tensor are not an exact affine copy of the checkpoint."""


def _segment(
    target: str, dst: torch.Tensor, src_offset: int, src_strides: tuple[int, ...], numel: int
) -> Segment:
    """The segment for `dst` receiving ids src_offset + sum(i[d] * src_strides[d]), or UnmappableLoader."""
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


def _sealed(storages: Mapping[int, str], probes: list[torch.Tensor]) -> Intercept:
    """The probe's interception: nothing that existed before is written (the probes aside)."""
    return Intercept(storages, inputs={storage_key(p): i for i, p in enumerate(probes)}, sealed=True)


def _run(load_weights, mode: Intercept, items: list[tuple[str, torch.Tensor]]) -> Intercept:
    """`load_weights` on the probes `items` under `mode`, its `current` the index of the one fed last."""

    def feed():
        for i, item in enumerate(items):
            mode.current = i
            yield item

    with torch.no_grad(), mode:
        load_weights(feed() if len(items) > 1 else items)
    return mode


def _copies_and_fills(mode: Intercept) -> tuple[list[Write], list[Fill]]:
    """One probe's writes: `copy_`s into parameters and scalar fills; UnmappableLoader for any other."""
    copies, fills, refused = [], [], []
    for w in mode.writes:
        if w.target is None:
            refused.append(f"{w.func} writes a tensor that is neither a parameter nor the loader's own")
        elif w.func is torch.ops.aten.copy_.default:
            copies.append(w)
        elif (fill := _fill(w)) is not None:
            fills.append(fill)
        else:
            refused.append(f"{w.func} writes parameter {w.target}")
    if refused:
        raise UnmappableLoader("loader writes outside a plain copy: " + "; ".join(sorted(set(refused))[:3]))
    return copies, fills


def _fill(w: Write) -> Fill | None:
    """The write as a fill of a parameter with a scalar, or None (a fill with a tensor may carry values)."""
    if w.target is None:
        return None
    if w.func is torch.ops.aten.zero_.default:
        value = 0
    elif w.func is torch.ops.aten.fill_.Scalar and type(w.src) in (bool, int, float):
        value = w.src
    else:
        return None
    d = w.dst
    return Fill(w.target, tuple(d.shape), d.storage_offset(), tuple(d.stride()), value, str(w.func))


def _owner(w: Write, probes: Mapping[int, int], dtypes: list[torch.dtype]) -> int | None:
    """The meta probe whose plain view `w` copies into a parameter, or None (the map is not proven)."""
    src = w.src
    if w.target is None or w.func is not torch.ops.aten.copy_.default or not isinstance(src, torch.Tensor):
        return None
    i = probes.get(storage_key(src))
    if i is None or src.dtype != dtypes[i] or src.is_neg() or src.is_conj():
        return None
    return i


def _ids_of(src: Any, dst: torch.Tensor, id_dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(src, torch.Tensor):
        raise UnmappableLoader("loader writes a constant")
    if src.dtype != id_dtype:
        raise UnmappableLoader(f"loader converted the probe to {src.dtype}")
    return src.broadcast_to(dst.shape)


def _affine_fit(ids: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Offset and per-dim strides such that ids == offset + sum(i[d] * stride[d]), or raise (checked a
    block of rows at a time, so temporaries stay bounded)."""
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
        if not torch.equal(expected, ids[r0 : r0 + rows].to(torch.int64)):
            raise UnmappableLoader("written values are not an affine view of the checkpoint tensor")
    return offset, tuple(strides)


def _careful(load_weights, storages: Mapping[int, str], placement: TensorPlacement) -> None:
    """`placement`'s segments and fills from element ids the loader copied, checked by a relabelled pass."""
    name, shape, numel = placement.name, placement.shape, math.prod(placement.shape)
    id_dtype = torch.int32 if numel <= _INT32_IDS else torch.int64
    ids = torch.arange(numel, dtype=id_dtype).reshape(shape)
    mode = _run(load_weights, _sealed(storages, [ids]), [(name, ids)])
    copies, filled = _copies_and_fills(mode)
    segments = [
        _segment(w.target, w.dst, *_affine_fit(_ids_of(w.src, w.dst, id_dtype)), numel) for w in copies
    ]
    read = storage_key(ids) in mode.read
    del mode, copies
    # A copy commutes with relabelling the ids; `w * 2`, `w + 1` or a sort does not.
    ids.bitwise_xor_(_RELABEL[id_dtype])
    relabelled, refilled = _copies_and_fills(_run(load_weights, _sealed(storages, [ids]), [(name, ids)]))
    if len(relabelled) != len(segments):
        raise UnmappableLoader("loader transforms values instead of copying them")
    if refilled != filled:
        raise UnmappableLoader("loader fills a parameter with values that follow the checkpoint tensor")
    for seg, w in zip(segments, relabelled):
        got = _ids_of(w.src, w.dst, id_dtype)
        want = torch.as_strided(ids.reshape(-1), got.shape, _src_strides_of(seg, w.dst), seg.src_offset)
        # The loader may have moved the ids to the parameter's device: compare there.
        if (
            w.target != seg.target
            or w.dst.storage_offset() != seg.dst_offset
            or not torch.equal(got, want.to(got.device))
        ):
            raise UnmappableLoader("loader transforms values instead of copying them")
    placement.segments, placement.read = segments, read
    placement.fills.extend(filled)


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
    found, _ = _probe_batch(load_weights, storages, [(name, (tuple(shape), dtype))])
    if found is not None:
        return found[name]
    placement = TensorPlacement(name, tuple(shape), dtype)
    try:
        _careful(load_weights, storages, placement)
    except UnmappableLoader as exc:
        placement.segments, placement.fills = [], []
        placement.fallback_reason = str(exc)
    except Exception as exc:  # a loader that rejects the probe cannot be mapped exactly
        placement.segments, placement.fills = [], []
        placement.fallback_reason = f"loader failed on the probe: {type(exc).__name__}: {exc}"
    return placement


class PeakRss:
    """Extra resident memory at the peak of a block (the kernel's high-water mark, reset first; None
    where /proc does not allow it). RSS: the probe's temporaries are CPU tensors no allocator counts."""

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


def _probe_batch(
    load_weights, storages: Mapping[int, str], items: list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]
) -> tuple[dict[str, TensorPlacement] | None, int]:
    """Placements of `items` from one `load_weights` call on meta probes (a copy is the tensor's whose
    probe it views, a scalar fill the one the loader was at), or (None, index of the tensor the loader
    was at where a write proves nothing: the careful pass decides)."""
    probes = [torch.empty(shape, dtype=dtype, device="meta") for _, (shape, dtype) in items]
    mode = _sealed(storages, probes)
    keys, dtypes = mode.inputs, [dtype for _, (_, dtype) in items]
    try:
        _run(load_weights, mode, [(name, p) for (name, _), p in zip(items, probes)])
    except Exception:  # e.g. a loader that reads values (`.item()`), which meta has none of
        return None, mode.current
    read = {i for k, i in keys.items() if k in mode.read}
    out = [
        TensorPlacement(name, tuple(shape), dtype, read=i in read)
        for i, (name, (shape, dtype)) in enumerate(items)
    ]
    bad = list(mode.input_writes)
    for w in mode.writes:
        if (i := _owner(w, keys, dtypes)) is None:
            if (fill := _fill(w)) is None:
                bad.append(w.at)
            else:
                out[w.at].fills.append(fill)
            continue
        src = w.src.expand(w.dst.shape)  # a view of the meta probe: its offset and strides are the map
        try:
            out[i].segments.append(
                _segment(w.target, w.dst, src.storage_offset(), tuple(src.stride()), math.prod(out[i].shape))
            )
        except UnmappableLoader:
            bad.append(i)
    return (None, min(bad)) if bad else ({p.name: p for p in out}, 0)


def build_placement(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    storages: Mapping[int, str],
    checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    batch: int = 1024,
) -> dict[str, TensorPlacement]:
    """Probe every checkpoint tensor once; log the ones that fall back to vLLM's loader.

    Why batches: each `load_weights` call pays vLLM's setup (46k times at 355B); a batch that
    `_probe_batch` cannot prove is split around the tensor it stopped at, down to `probe_tensor`.
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
    refuse_overlapping_fills(placements)
    fallbacks = {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}
    if fallbacks:
        logger.warning("delta updates: %d tensors fall back to vLLM's loader: %s", len(fallbacks), fallbacks)
    return placements
