"""Learning placements: where each checkpoint element lives on this rank, from the model's own loaders.

Why: writing a changed element straight into the parameter slot that holds it is O(changed);
replaying `load_weights` over a full-shape staged tensor is O(model). Rather than hand-written
per-model tables, we run `model.load_weights` once per checkpoint tensor under a thread-local
TorchDispatchMode (`ProbeMode`) that records, and never performs, every write into a parameter.
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
the filled elements (`refuse_overlapping_fills`, once every tensor is probed): those elements
are no checkpoint element, a delta never changes them, and they keep what vLLM's load put there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from vllm_delta.engine.placement import Fill, Segment, TensorPlacement, refuse_overlapping_fills
from vllm_delta.engine.probe_modes import BatchMode, ProbeMode

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


def _segment(
    target: str, dst: torch.Tensor, src_offset: int, src_strides: tuple[int, ...], numel: int
) -> Segment:
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


def _run(load_weights, storages: Mapping[int, str], name: str, probe: torch.Tensor) -> ProbeMode:
    mode = ProbeMode(storages, probe)
    with torch.no_grad(), mode:
        load_weights([(name, probe)])
    if mode.refused:
        raise UnmappableLoader(
            "loader writes outside a plain copy: " + "; ".join(sorted(set(mode.refused))[:3])
        )
    return mode


def _fast(
    load_weights,
    storages: Mapping[int, str],
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    numel: int,
    fills: list[Fill] | None = None,
) -> tuple[list[Segment], bool]:
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
        if not (
            isinstance(src, torch.Tensor)
            and mode.is_probe(src)
            and src.dtype == dtype
            and not src.is_neg()
            and not src.is_conj()
        ):
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
        if not torch.equal(expected, ids[r0 : r0 + rows].to(torch.int64)):
            raise UnmappableLoader("written values are not an affine view of the checkpoint tensor")
    return offset, tuple(strides)


def _careful(
    load_weights,
    storages: Mapping[int, str],
    name: str,
    shape: tuple[int, ...],
    numel: int,
    fills: list[Fill] | None = None,
) -> tuple[list[Segment], bool]:
    """Segments from element ids the loader copied, checked against a relabelled second pass.
    The loader's constant fills (the same in both passes) are added to `fills`."""
    id_dtype = torch.int32 if numel <= _INT32_IDS else torch.int64
    ids = torch.arange(numel, dtype=id_dtype).reshape(shape)
    mode = _run(load_weights, storages, name, ids)
    segments = [
        _segment(w.target, w.dst, *_affine_fit(_ids_of(w.src, w.dst, id_dtype)), numel) for w in mode.writes
    ]
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
        if (
            w.target != seg.target
            or w.dst.storage_offset() != seg.dst_offset
            or not torch.equal(got, want.to(got.device))
        ):
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
            placement.segments, placement.read = _fast(
                load_weights, storages, name, tuple(shape), dtype, numel, placement.fills
            )
        except _NotDirect as why:
            logger.debug("delta updates: %s needs the careful probe (%s)", name, why)
            placement.segments, placement.read = _careful(
                load_weights, storages, name, tuple(shape), numel, placement.fills
            )
    except UnmappableLoader as exc:
        placement.segments, placement.fills = [], []
        placement.fallback_reason = str(exc)
    except Exception as exc:  # a loader that rejects the probe cannot be mapped exactly
        placement.segments, placement.fills = [], []
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


def _probe_batch(
    load_weights, storages: Mapping[int, str], items: list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]
) -> tuple[dict[str, TensorPlacement] | None, int]:
    """Placements of `items` from one `load_weights` call on meta probes, or (None, index of the
    tensor the loader was at when the batch stopped being provable)."""
    probes = [torch.empty(shape, dtype=dtype, device="meta") for _, (shape, dtype) in items]
    mode = BatchMode(
        storages,
        {p.untyped_storage()._cdata: i for i, p in enumerate(probes)},
        [dtype for _, (_, dtype) in items],
    )

    def feed():
        for i, ((name, _), probe) in enumerate(zip(items, probes)):
            mode.current = i
            yield name, probe

    try:
        with torch.no_grad(), mode:
            load_weights(feed())
    except Exception:  # e.g. a loader that reads values; per tensor, the careful pass decides
        mode.reject()
    if mode.rejected is not None:
        return None, mode.rejected
    out = {}
    for i, (name, (shape, dtype)) in enumerate(items):
        numel = torch.Size(shape).numel()
        placement = TensorPlacement(name, tuple(shape), dtype, read=i in mode.read)
        try:
            for w in mode.writes.get(i, ()):
                src = w.src.expand(w.dst.shape)
                placement.segments.append(
                    _segment(w.target, w.dst, src.storage_offset(), tuple(src.stride()), numel)
                )
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
    probes goes through one call; a batch that `BatchMode` cannot prove is split around the
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
    refuse_overlapping_fills(placements)
    fallbacks = {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}
    if fallbacks:
        logger.warning("delta updates: %d tensors fall back to vLLM's loader: %s", len(fallbacks), fallbacks)
    return placements
