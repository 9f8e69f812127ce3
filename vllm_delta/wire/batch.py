"""Decoding a block-indexed flush's params together, a fixed number of numpy calls a batch. Why: at 44k
tensors of a few changes each, the per-param path (flush.py) pays ~0.3 ms a tensor. A fast path only:
input it does not expect raises `Fallback`, and the per-param path decodes from there (its precise error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any

import numpy as np
import torch

from .batch_device import Decoder
from .batch_host import Fallback, FlushIndex, HostBatch
from .blocks import BlockIndex, merge
from .blocks import wanted as block_wanted
from .codecs import GAP_WIDTHS, check_numel
from .deltas import DeltaBatch, ParamDelta
from .dtypes import DType, by_name
from .encodings import Encoding, UlpSteps
from .errors import DeltaError
from .flush_meta import Heads, Rows

BATCH_ENTRIES = 1 << 19  # decoded entries per batch: bounds its temporaries (about 100 B an entry)
# Past this many wanted entries a param decodes 3-6x cheaper a change on the per-param path.
PER_PARAM_ENTRIES = 1 << 13
DEVICE_BATCH_ENTRIES = 1 << 22  # a device batch's ~86 ops are launches: more entries (~0.5 GB of int64)
# Host batches also end every BATCH_PARAMS params: the next sync's batches recur (and the stager's plans).
BATCH_PARAMS = 1 << 12


def _supported(enc: Encoding) -> bool:
    return enc.compression != "none"  # `indices` and `deltas` store raw streams: the per-param path's


def _streams(enc: Encoding, width: int, itemsize: int) -> list[str]:
    """The streams the writer lists for a param of this gap width and value width, in its order."""
    pos = [f"pos{j}" for j in range(width)] if enc.positions.planes else ["positions"]
    if isinstance(enc.values, UlpSteps):
        val = ["sign", "flag", *(f"esc{j}" for j in range(itemsize))]
    elif enc.values.planes:
        val = [f"val{j}" for j in range(itemsize)]
    else:
        val = ["values"]
    return pos + val


def parse(
    enc: Encoding,
    smeta: Mapping,
    data: Mapping[str, memoryview],
    meta: Heads,
    *,
    file: str,
    expected: Mapping | None,
) -> FlushIndex:
    """Validate every param's head and block index against the streams at once, as columns (each distinct
    (dtype, shape) once, the model's heads in one comparison), or `Fallback`."""
    if not _supported(enc) or any(s.codec != "zstd" for s in smeta.values()) or not meta.name:
        raise Fallback
    columns = {s: j for j, s in enumerate(smeta)}
    shapes = list(map(tuple, meta.shape))
    keys = list(zip(meta.dtype, shapes))
    known: dict[tuple, tuple[DType, int]] = {}
    try:
        for dname, shape in set(keys):
            numel_k = math.prod(shape)
            check_numel(numel_k)
            known[(dname, shape)] = (by_name(dname), numel_k)
    except DeltaError:
        raise Fallback from None
    got = list(map(known.__getitem__, keys))
    dtypes = list(map(itemgetter(0), got))
    numel = list(map(itemgetter(1), got))
    torch_dtypes = list(map(attrgetter("torch"), dtypes))
    # The model's (shape, dtype) of every param in one comparison (a torch.Size equals its tuple).
    if expected is not None and list(map(expected.get, meta.name)) != list(zip(shapes, torch_dtypes)):
        raise Fallback
    if not set(meta.width) <= set(GAP_WIDTHS):
        raise Fallback
    itemsizes = list(map(attrgetter("itemsize"), torch_dtypes))
    skeys = list(zip(meta.width, itemsizes, map(tuple, meta.streams)))
    stream_cols: dict[tuple, list[int]] = {}
    try:
        for width, itemsize, listed in set(skeys):
            if list(listed) != _streams(enc, width, itemsize):
                raise Fallback
            stream_cols[(width, itemsize, listed)] = [columns[s] for s in listed]
    except KeyError:
        raise Fallback from None
    cols = list(map(stream_cols.__getitem__, skeys))
    widths = meta.width
    block_rows = meta.rows or Rows.of(meta.blocks)
    if block_rows is None:
        raise Fallback
    nrows, head, flat = block_rows.nrows, block_rows.head, block_rows.lens
    if not nrows.all():
        raise Fallback
    nstreams = np.fromiter(map(len, cols), dtype=np.int64, count=len(cols))
    per_row = np.repeat(nstreams, nrows)
    if not np.array_equal(block_rows.frames, 2 * per_row):
        raise Fallback
    nrow_total = head.shape[0]
    row0 = np.concatenate(([0], np.cumsum(nrows)))
    first, last, cnt = head[:, 0], head[:, 1], head[:, 2]
    numel_a = np.array(numel, dtype=np.int64)
    try:
        count_a = np.array(meta.count, dtype=np.int64)
    except OverflowError:
        raise Fallback from None
    if bool((count_a > numel_a).any()):
        raise Fallback
    pid = np.repeat(np.arange(nrows.size), nrows)
    same = pid[1:] == pid[:-1]
    ends = row0[1:] - 1
    notlast = np.ones(nrow_total, dtype=bool)
    notlast[ends] = False
    ok = (
        bool((first[row0[:-1]] >= 0).all())
        and bool((last[ends] < numel_a).all())
        and bool((first <= last).all())
        and bool((last[:-1][same] < first[1:][same]).all())
        and bool((cnt <= last - first + 1).all())
        and bool((cnt >= 1).all())
        and np.array_equal(np.add.reduceat(cnt, row0[:-1]), count_a)
        and bool((cnt[notlast] % 8 == 0).all())
        and bool((flat >= 0).all())
    )
    if not ok or (flat.size and int(flat.max()) > np.iinfo(np.int64).max // flat.size):
        raise Fallback  # (the lengths' sums below could wrap in int64: the per-param path sums Python ints)
    # Each row's stream columns: its param's, row after row (ranges of the params' concatenated columns).
    col_start = np.cumsum(nstreams) - nstreams
    col = np.fromiter(chain.from_iterable(cols), dtype=np.int64, count=int(nstreams.sum()))[
        np.repeat(col_start[pid] - (np.cumsum(per_row) - per_row), per_row) + np.arange(int(per_row.sum()))
    ]
    rid = np.repeat(np.arange(nrow_total), per_row)
    shape2 = (nrow_total, len(columns))
    has = np.zeros(shape2, dtype=bool)
    stored = np.zeros(shape2, dtype=np.int64)
    decoded = np.zeros(shape2, dtype=np.int64)
    has[rid, col] = True
    stored[rid, col] = flat[0::2]
    decoded[rid, col] = flat[1::2]
    sizes = np.array([len(data[s]) for s in columns], dtype=np.int64)
    declared = np.array([smeta[s].size for s in columns], dtype=np.int64)
    if not (np.array_equal(stored.sum(axis=0), sizes) and np.array_equal(decoded.sum(axis=0), declared)):
        raise Fallback
    return FlushIndex(
        list(meta.name),
        dtypes,
        shapes,
        numel_a,
        count_a,
        np.array(widths, dtype=np.int64),
        np.array(itemsizes, dtype=np.int64),
        row0,
        first,
        last,
        cnt,
        has,
        stored,
        decoded,
        np.cumsum(stored, axis=0) - stored,
        columns,
        pid,
    )


def wanted(ix: FlushIndex, owned: Mapping | None) -> np.ndarray:
    """Per row: does the block meet its param's owned ranges (`blocks.wanted`, for all params at once)."""
    rows = ix.first.size
    if owned is None:
        return np.ones(rows, dtype=bool)
    lo = np.zeros(len(ix.names), dtype=np.int64)
    hi = ix.numel - 1
    got: list[Any] = list(map(owned.get, ix.names))  # each param's ranges, or None
    given = list(map(is_not, got, repeat(None)))
    at = np.flatnonzero(np.array(given, dtype=bool))
    ranges = np.fromiter(map(len, compress(got, given)), dtype=np.int64, count=at.size)
    one = at[ranges == 1]  # merged, a range is itself
    if one.size:
        lo[one], hi[one] = (
            np.array(list(map(itemgetter(0), map(got.__getitem__, one.tolist()))), dtype=np.int64)
            .reshape(-1, 2)
            .T
        )
    mask = (ix.first <= hi[ix.pid]) & (ix.last >= lo[ix.pid])
    for p in at[ranges != 1].tolist():  # several ranges (or none): the per-param rule
        a, b = ix.row0[p], ix.row0[p + 1]
        sub = BlockIndex(ix.first[a:b], ix.last[a:b], ix.cnt[a:b], ix.stored[a:b], ix.decoded[a:b])
        mask[a:b] = block_wanted(sub, merge(got[p]))
    return mask


def decode(
    enc: Encoding,
    ix: FlushIndex,
    data: Mapping[str, memoryview],
    owned: Mapping | None,
    decoder: Decoder,
    fallback: Callable[[int, int], Iterator],
    batches: bool = False,
) -> Iterator[ParamDelta | DeltaBatch]:
    """Decode the params a batch at a time; a batch this path does not take, and a host param of at least
    PER_PARAM_ENTRIES wanted entries, go to `fallback(p, q)` (the per-param path for params p..q-1).

    The params `decoder.devices` places are decoded there (their checks left for `decoder.verify`). Each
    param comes as a `ParamDelta`; with `batches`, a batch decoded on the host alone as one `DeltaBatch`.
    """
    mask = wanted(ix, owned)
    pid, names, shapes, needs_base = ix.pid, ix.names, ix.shapes, enc.needs_base
    dtypes = list(map(attrgetter("torch"), ix.dtypes))
    run_start = mask.copy()  # a wanted row whose predecessor in its param is not wanted
    run_start[1:] &= ~(mask[:-1] & (pid[1:] == pid[:-1]))
    per_param = np.add.reduceat(np.where(mask, ix.cnt, 0), ix.row0[:-1])
    nparams = len(ix.names)
    # A batch holds host params and device params (each part decoded on its own, yielded in order).
    on_dev = np.zeros(nparams, dtype=bool)
    if decoder.devices:
        on_dev = np.fromiter(map(decoder.devices.__contains__, names), dtype=bool, count=nparams)
    changes = np.zeros(0, np.int64) if on_dev.any() else np.arange(BATCH_PARAMS, nparams, BATCH_PARAMS)
    large = np.flatnonzero((per_param >= min(PER_PARAM_ENTRIES, BATCH_ENTRIES)) & ~on_dev)
    p = 0
    while p < nparams:
        here = per_param[p:]
        q = p + min(
            int(np.searchsorted(np.cumsum(np.where(on_dev[p:], 0, here)), BATCH_ENTRIES, side="right")),
            int(
                np.searchsorted(np.cumsum(np.where(on_dev[p:], here, 0)), DEVICE_BATCH_ENTRIES, side="right")
            ),
        )
        c = int(np.searchsorted(changes, p, side="right"))
        q = min(q, int(changes[c]) if c < changes.size else nparams)
        k = int(np.searchsorted(large, p))
        q = min(q, int(large[k]) if k < large.size else nparams)  # a batch stops before a large host param
        if q == p and not on_dev[p]:  # a large param: its own decode holds no more than the per-param path's
            yield from fallback(p, p + 1)
            p += 1
            continue
        q = max(q, p + 1)  # a device param past DEVICE_BATCH_ENTRIES is a batch of its own
        a, b = int(ix.row0[p]), int(ix.row0[q])
        rows = a + np.flatnonzero(mask[a:b])
        dev_row = on_dev[pid[rows]]
        sizes_at = set(ix.itemsize[p:q].tolist())
        try:
            # (positions, values by width) on the device (True) and on the host (False)
            parts: dict[bool, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
            for there in (False, True):
                if (on_dev[p:q] == there).any():
                    sub = HostBatch(ix, data, rows[dev_row == there], run_start)
                    parts[there] = decoder.decode(sub, enc, decoder.device if there else None, sizes_at)
        except Fallback:
            yield from fallback(p, q)
            p = q
            continue
        if True in parts:
            decoder.decoded.update(compress(names[p:q], on_dev[p:q]))
        sizes = per_param[p:q].tolist()
        kinds_k = on_dev[p:q].tolist()
        types = ix.itemsize[p:q].tolist() if needs_base else dtypes[p:q]
        row0 = ix.row0[p : q + 1]
        nwanted = np.add.reduceat(mask[a:b].astype(np.int64), row0[:-1] - a).tolist()
        cols = [
            names[p:q],
            shapes[p:q],
            dtypes[p:q],
            types,
            sizes,
            ix.count[p:q].tolist(),
            ix.first[row0[:-1]].tolist(),
            ix.last[row0[1:] - 1].tolist(),
            list(zip(nwanted, np.diff(row0).tolist())),
            ix.itemsize[p:q].tolist(),
        ]
        made = {}  # one DeltaBatch a part: its params' views come from one split per value type
        for there, (pos, by_size) in parts.items():
            keep = list(map(bool.__eq__, kinds_k, repeat(there)))
            n, sh, dt, ty, sz, ct, fi, la, nb, isz = (list(compress(c, keep)) for c in cols)
            values = {t: by_size[t] if needs_base else by_size[t.itemsize].view(t) for t in dict.fromkeys(ty)}
            skipped = list(map(int.__sub__, ct, sz))
            nbytes = pos.nbytes + int(np.dot(sz, isz))
            made[there] = DeltaBatch(
                n, sh, dt, pos, values, ty, sz, needs_base, ct, skipped, fi, la, nb, nbytes
            )
        p = q
        if batches and True not in made:
            yield made[False]
            continue
        each = {there: batch.deltas() for there, batch in made.items()}
        for on in kinds_k:  # in flush order, made as consumed, so few params live at once
            yield next(each[on])
