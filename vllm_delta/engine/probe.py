"""Learning where each checkpoint element lives on this rank from the model's own loaders (writing a
changed element is O(changed), a `load_weights` O(model)): run sealed on `meta` probes, a `copy_` of a
probe's view maps ids by its strides; else real, then XOR-relabelled, ids tell a copy from arithmetic."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch

from vllm_delta.engine.intercept import Intercept, LoadWeights, Write, storage_key
from vllm_delta.engine.placement import Fill, Segment, TensorPlacement, grid, refuse_overlapping_fills

logger = logging.getLogger(__name__)

_INT32_IDS = 1 << 30  # the careful pass's ids: int32 while every relabelled id fits
_RELABEL = {torch.int32: 0x2AAAAAAA, torch.int64: 0x2AAAAAAAAAAAAAAA}
_FIT_BLOCK = 1 << 20  # ids compared at a time by the careful pass (bounds its int64 temporaries)

Shapes = list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]


class UnmappableLoader(Exception):
    """The loader's writes for a tensor are not an exact affine copy of the checkpoint."""


def _segment(
    target: str, dst: torch.Tensor, src_offset: int, src_strides: tuple[int, ...], numel: int
) -> Segment:
    """The segment for `dst` receiving ids src_offset + sum(i[d] * src_strides[d]), or UnmappableLoader."""
    dims = sorted((d for d in range(dst.dim()) if dst.shape[d] > 1), key=lambda d: -src_strides[d])
    if any(src_strides[d] <= 0 for d in dims):
        raise UnmappableLoader("loader repeats or reverses checkpoint elements")
    sizes = tuple(dst.shape[d] for d in dims)
    s_src = tuple(src_strides[d] for d in dims)
    span = 0  # unique inversion needs each stride to exceed the span of all smaller ones
    for n, s in reversed(list(zip(sizes, s_src))):
        if s <= span:
            raise UnmappableLoader("overlapping source strides")
        span += (n - 1) * s
    seg = Segment(
        target, sizes, src_offset, s_src, dst.storage_offset(), tuple(dst.stride()[d] for d in dims)
    )
    if src_offset < 0 or seg.src_last >= numel:
        raise UnmappableLoader("loader wrote ids outside the checkpoint tensor")
    return seg


def copies_and_fills(mode: Intercept, fills: bool = True) -> tuple[list[Write], list[Fill]]:
    """A loader's writes as `copy_`s into parameters and (if `fills`) scalar fills, else UnmappableLoader."""
    copies, filled, refused = [], [], []
    for w in mode.writes:
        if w.target is None:
            refused.append(f"{w.func} writes a tensor that is neither a parameter nor the loader's own")
        elif w.func is torch.ops.aten.copy_.default:
            copies.append(w)
        elif fills and (fill := _fill(w)) is not None:
            filled.append(fill)
        else:
            refused.append(f"{w.func} writes parameter {w.target}")
    if refused:
        why = "; ".join(sorted(set(refused))[:3])
        raise UnmappableLoader(f"loader writes parameters in place, outside a plain copy: {why}")
    return copies, filled


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


def _fit(w: Write, id_dtype: torch.dtype, numel: int, relabel: int = 0) -> Segment:
    """The segment `w` copies into, from the ids it writes (XOR-ed back with `relabel`)."""
    if not isinstance(w.src, torch.Tensor):
        raise UnmappableLoader("loader writes a constant")
    if w.src.dtype != id_dtype:
        raise UnmappableLoader(f"loader converted the probe to {w.src.dtype}")
    ids = w.src.broadcast_to(w.dst.shape)
    return _segment(w.target, w.dst, *_affine_fit(ids ^ relabel if relabel else ids), numel)


def _affine_fit(ids: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """(offset, strides) with ids == offset + sum(i[d] * strides[d]), or raise (a block of rows at a time)."""
    if ids.numel() == 0:
        raise UnmappableLoader("empty write")
    if ids.dim() == 0:
        return int(ids), ()
    offset = int(ids.reshape(-1)[0])
    strides = tuple(
        int(ids[tuple(int(j == d) for j in range(ids.dim()))]) - offset if n > 1 else 0
        for d, n in enumerate(ids.shape)
    )
    rows = max(1, _FIT_BLOCK // max(ids[0].numel(), 1))
    for r0 in range(0, ids.shape[0], rows):
        block = ids[r0 : r0 + rows]
        expected = grid(offset + r0 * strides[0], block.shape, strides, ids.device)
        if not torch.equal(expected, block.to(torch.int64)):
            raise UnmappableLoader("written values are not an affine view of the checkpoint tensor")
    return offset, strides


def _careful(load_weights: LoadWeights, storages: Mapping[int, str], placement: TensorPlacement) -> None:
    """`placement`'s segments and fills from element ids the loader copied, checked by a relabelled pass."""
    name, numel = placement.name, math.prod(placement.shape)
    id_dtype = torch.int32 if numel <= _INT32_IDS else torch.int64
    fed = [(name, torch.arange(numel, dtype=id_dtype).reshape(placement.shape))]
    mode = Intercept.sealed_on(storages, fed).run(load_weights, fed)
    copies, filled = copies_and_fills(mode)
    segments = [_fit(w, id_dtype, numel) for w in copies]
    read = storage_key(fed[0][1]) in mode.read
    del mode, copies
    # A copy commutes with relabelling the ids; `w * 2`, `w + 1` or a sort does not.
    fed[0][1].bitwise_xor_(_RELABEL[id_dtype])
    relabelled, refilled = copies_and_fills(Intercept.sealed_on(storages, fed).run(load_weights, fed))
    if refilled != filled:
        raise UnmappableLoader("loader fills a parameter with values that follow the checkpoint tensor")
    if [_fit(w, id_dtype, numel, _RELABEL[id_dtype]) for w in relabelled] != segments:
        raise UnmappableLoader("loader transforms values instead of copying them")
    placement.segments, placement.fills, placement.read = segments, filled, read


def probe_tensor(
    load_weights: LoadWeights,
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
        placement.fallback_reason = str(exc)
    except Exception as exc:  # a loader that rejects the probe cannot be mapped exactly
        placement.fallback_reason = f"loader failed on the probe: {type(exc).__name__}: {exc}"
    return placement


class PeakRss:
    """Extra resident memory at the peak of a block (None where /proc cannot reset VmHWM): RSS, as the
    probe's temporaries are CPU tensors no allocator counts."""

    extra: int | None = None
    _base: int | None = None

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
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self._base is not None:
            self.extra = max(0, self._kib("VmHWM") - self._base) << 10


def _probe_batch(
    load_weights: LoadWeights, storages: Mapping[int, str], items: Shapes
) -> tuple[dict[str, TensorPlacement] | None, int]:
    """Placements of `items` from one `load_weights` call on meta probes, or (None, index of the tensor
    the loader was at where a write proves nothing: the careful pass decides)."""
    fed = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, (shape, dtype) in items]
    mode = Intercept.sealed_on(storages, fed)
    try:
        mode.run(load_weights, fed)
    except Exception:  # e.g. a loader that reads values (`.item()`), which meta has none of
        return None, mode.current
    keys, dtypes = mode.inputs, [dtype for _, (_, dtype) in items]
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
    load_weights: LoadWeights,
    storages: Mapping[int, str],
    checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    batch: int = 1024,
) -> dict[str, TensorPlacement]:
    """Probe every checkpoint tensor, in batches (each `load_weights` call pays vLLM's setup), split around
    the tensor a batch cannot prove, down to `probe_tensor`."""
    items = list(checkpoint.items())
    found: dict[str, TensorPlacement] = {}
    pending = [(0, len(items))]
    while pending:
        lo, hi = pending.pop()
        if hi - lo > batch:
            pending += [(lo + batch, hi), (lo, lo + batch)]
        elif hi - lo == 1:
            name, (shape, dtype) = items[lo]
            found[name] = probe_tensor(load_weights, storages, name, shape, dtype)
        elif (result := _probe_batch(load_weights, storages, items[lo:hi]))[0] is not None:
            found.update(result[0])
        else:  # the rest of the batch is probed again, the tensor at fault alone
            k = lo + result[1]
            pending += [r for r in [(k + 1, hi), (k, k + 1), (lo, k)] if r[1] > r[0]]
    placements = {name: found[name] for name, _ in items}
    refuse_overlapping_fills(placements)
    if fallbacks := {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}:
        logger.warning("delta updates: %d tensors fall back to vLLM's loader: %s", len(fallbacks), fallbacks)
    return placements
