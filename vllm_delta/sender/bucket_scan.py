"""One pass over a contiguous bucket of weights: the diff, gather, HF map and digests of every shard in
it, in a bounded number of torch ops per bucket. Why: under Megatron's distributed optimizer a rank holds
~1000 HF segments of one buffer, and diffing them one by one cost ~85 small kernels and 1-3 host syncs
each. Changed offsets map to (segment, HF position) through a table of runs; on CPU weights
`kernels/scan.py` runs the whole pass fused (the torch ops here cost ~10x a memcpy there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_delta.diff import _cpu_pool, changed_positions
from vllm_delta.kernels import scan as scan_kernel
from vllm_delta.kernels.digest import bits, segment_sums
from vllm_delta.kernels.scan import ScanBuffers, numpy_tables, values
from vllm_delta.sender.shards import Runs, Segments, Shard, flat_runs, strided

# Elements compared per op: a 256 M-element bool mask (256 MiB) at most on an accelerator, so a
# multi-GB bucket is a few dozen chunks. The CPU diff chunks (and threads) within each.
DEVICE_CHUNK = 1 << 28
# A shard whose local order breaks into more runs than this is a bucket of its own (HF map by `to_global`).
MAX_RUNS = 1 << 16
_CPUS = os.cpu_count()  # as the diff's pool decides (a call per bucket costs ~30 us here)
# a bucket member: (shard, its storage runs, its (storage start, HF start, length) runs)
Member = tuple[Shard | Segments, list[tuple[int, int]], list[tuple[int, int, int]]]


@dataclass(eq=False)
class Layout:
    """Where each member's elements sit in the bucket; runs map an offset to (member, HF position)."""

    key: tuple
    names: tuple[str, ...]  # members, in order of their first element in the bucket
    base: torch.Tensor  # flat view of the live storage over the bucket's span
    local_runs: tuple[Runs, ...]  # per member: (bucket offset, length) in local order, `strided` (a view)
    rows: tuple[tuple[int, int, int, int], ...]  # runs (bucket offset, HF start, length, member), sorted
    tables: tuple[torch.Tensor, ...]  # `run_tables(rows)` on the weights' device
    in_order: bool  # bucket order is already (member, HF) order: no sort of the changes
    gaps: bool  # the span holds elements no member covers (padding, unregistered params)
    buffers: ScanBuffers = field(default_factory=ScanBuffers, repr=False)  # the CPU kernel's outputs
    kernel_views: tuple | None = field(default=None, repr=False)  # `kernel_args`' answer and its snapshot
    to_global: Callable | None = None  # a bucket of one whose HF runs are too many: its shard's map

    def kernel_args(self, snap: torch.Tensor) -> tuple:
        """(`base`'s bits, `snap`'s bits, run-table columns) as numpy views, made once per snapshot."""
        if self.kernel_views is None or self.kernel_views[0] is not snap:
            self.kernel_views = (snap, bits(self.base), bits(snap), numpy_tables(self.tables))
        return self.kernel_views[1:]


def storage_runs(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """`(storage offset, length)` runs of `t`'s elements in row-major order (None: too many, or strided)."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    merged: list[list[int]] = []
    for n, s in reversed(dims):  # coalesce from the inside out
        if merged and merged[-1][1] * merged[-1][0] == s:
            merged[-1][0] *= n
        else:
            merged.append([n, s])
    if not merged:
        return [(t.storage_offset(), t.numel())] if t.numel() else []
    inner_n, inner_s = merged[0]
    if inner_s != 1 and inner_n > 1:
        return None
    outer = merged[1:]
    count = math.prod(n for n, _ in outer)
    if count > MAX_RUNS:
        return None
    starts = [t.storage_offset()]
    for n, s in reversed(outer):  # row-major: the outermost dim varies slowest
        starts = [a + i * s for a in starts for i in range(n)]
    return [(a, inner_n) for a in starts]


def hf_runs(s: Shard | Segments) -> Runs | None:
    """`(HF flat start, length)` runs covering the local elements in order."""
    if isinstance(s, Segments):
        return s.runs
    if math.prod(s.full_shape[: s.dim]) * len(s.spans) > MAX_RUNS:
        return None
    return flat_runs(s.full_shape, s.dim, s.spans)


def _merge(buf: list[tuple[int, int]], hf: Runs) -> list[tuple[int, int, int]]:
    """Intersect two partitions of the local order into `(buffer start, HF start, length)` runs."""
    out, i, j, bi, hj = [], 0, 0, 0, 0  # bi/hj: elements of the current runs already used
    while i < len(buf) and j < len(hf):
        n = min(buf[i][1] - bi, hf[j][1] - hj)
        out.append((buf[i][0] + bi, hf[j][0] + hj, n))
        bi, hj = bi + n, hj + n
        if bi == buf[i][1]:
            i, bi = i + 1, 0
        if hj == hf[j][1]:
            j, hj = j + 1, 0
    return out


def plan(shards: list[Shard | Segments], known: dict[tuple, Layout] | None = None) -> list[Layout]:
    """Every shard's bucket: shards sharing a storage in one (those in `known` reused; O(runs), no torch
    op), and a bucket of its own over a contiguous copy made now for a shard with too many runs, a
    non-unit inner stride, or elements shared with another shard."""
    groups: dict[tuple, list[Member]] = {}
    own = []
    for s in shards:
        t = s.tensor  # metadata only: no torch op per shard
        buf, hf = storage_runs(t), hf_runs(s)
        if buf is None or hf is None or t.numel() == 0 or not strided(buf):
            own.append((s, hf))
            continue
        key = t.device, t.dtype, t.untyped_storage()._cdata  # the StorageImpl (on meta data_ptr is 0)
        groups.setdefault(key, []).append((s, buf, _merge(buf, hf)))
    layouts = []
    for key, members in groups.items():
        flat = sorted((b, b + n) for _, buf, _ in members for b, n in buf)
        if any(e1 > b2 for (_, e1), (b2, _) in zip(flat, flat[1:])):  # overlapping shards (tied views)
            own.extend((s, hf_runs(s)) for s, _, _ in members)
            continue
        members.sort(key=lambda m: m[1][0][0])
        full_key = key + tuple((s.name, tuple(runs)) for s, _, runs in members)
        layout = (known or {}).get(full_key)
        if layout is None:
            lo = min(b for _, buf, _ in members for b, _ in buf)
            hi = max(b + n for _, buf, _ in members for b, n in buf)
            base = members[0][0].tensor.detach().as_strided((hi - lo,), (1,), lo)
            layout = _layout(full_key, members, base, lo)
        layouts.append(layout)
    for s, hf in own:
        base = s.tensor.detach().reshape(-1)
        runs = _merge([(0, base.numel())], hf) if hf is not None and base.numel() else [(0, 0, base.numel())]
        layout = _layout((base.device, base.dtype, "own", s.name), [(s, [(0, base.numel())], runs)], base, 0)
        if hf is None:
            layout.to_global, layout.in_order = s.to_global, s.is_whole
        layouts.append(layout)
    return layouts


def _layout(key: tuple, members: list[Member], base: torch.Tensor, lo: int) -> Layout:
    """The layout of `members` whose storage runs start at `lo` in their storage, over `base`."""
    rows = tuple(sorted((b - lo, h, n, k) for k, (_, _, runs) in enumerate(members) for b, h, n in runs))
    keys = [(k, h) for _, h, _, k in rows]
    names = tuple(s.name for s, _, _ in members)
    local_runs = tuple(tuple((b - lo, n) for b, n in buf) for _, buf, _ in members)
    gaps = sum(r[2] for r in rows) != base.numel()
    return Layout(
        key, names, base, local_runs, rows, run_tables(rows, base.device), keys == sorted(keys), gaps
    )


def run_tables(rows: tuple[tuple[int, int, int, int], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """int64 per run: start, end, HF shift (minus the offset), member, rank in (member, HF) order."""
    t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).t().contiguous()
    rank = torch.empty_like(t[0])
    rank[
        torch.tensor(sorted(range(len(rows)), key=lambda i: (rows[i][3], rows[i][1])), dtype=torch.int64)
    ] = torch.arange(len(rows))
    return tuple(x.to(device) for x in (t[0], t[0] + t[2], t[1] - t[0], t[3], rank))


@dataclass(eq=False)
class BucketScan:
    """One bucket's changes, still where the snapshot lives. Sent arrays are ordered by (member, HF)."""

    pos: torch.Tensor  # changed bucket offsets, sorted (what advances the snapshot)
    new: torch.Tensor  # their current values
    hf: torch.Tensor  # HF positions sent, member by member, each member's sorted
    send_new: torch.Tensor
    send_old: torch.Tensor | None
    digest: torch.Tensor  # int64 [n, 2]: each member's additive digest after the change
    summary: torch.Tensor  # int64: digest, pre, post ([n, 2] each, flattened), changed[n], sent[n]


def scan(
    layout: Layout, snap: torch.Tensor, digests: torch.Tensor, pending: torch.Tensor | None, kind: str
) -> BucketScan:
    """Diff and digest the bucket's live span against `snap`, where `snap` lives (a host snapshot's live
    span comes over chunk by chunk); `digests`: each member's [n, 2]."""
    n = len(layout.names)
    catchup = kind == "catchup" and pending is not None
    kernel = layout.to_global is None and scan_kernel.applies(layout.base, snap)  # CPU: one fused pass
    if kernel and not catchup and layout.in_order:
        return _kernel_scan(layout, snap, digests, n)
    tables = tuple(t.to(snap.device) for t in layout.tables)
    if kernel:
        pos, old, new, hf, run, pre, post = scan_kernel.diff_digest(
            layout.base, snap, tables, n, not layout.in_order, *_kernel_workers(), layout.buffers
        )
    else:
        pos, old, new, hf, run, pre, post = torch_diff_digest(layout, tables, snap, n)
    digest = digests - pre + post
    sent, send_hf, send_new, send_old, send_run = pos, hf, new, old, run
    if catchup:
        sent = union(pending, pos)
        send_seg, send_hf, _, send_run = _map(layout, tables, sent)
        base = layout.base  # the live weights may be on another device than the snapshot
        send_new = base[sent] if base.device == sent.device else base[sent.to(base.device)].to(sent.device)
        send_old = None
        post = segment_sums(send_hf, send_new, 0 if send_seg is None else send_seg, n)
    if not layout.in_order:  # runs interleave (a fused qkv): stable by run rank is (member, HF) order
        order = torch.argsort(send_hf if send_run is None else tables[4][send_run], stable=True)
        send_hf, send_new = send_hf[order], send_new[order]
        send_old = send_old[order] if send_old is not None else None
    counts = torch.cat([count(tables, n, pos), count(tables, n, sent)])
    summary = torch.cat([digest.reshape(-1), pre.reshape(-1), post.reshape(-1), counts.reshape(-1)])
    return BucketScan(pos, new, send_hf, send_new, send_old, digest, summary)


def _kernel_scan(layout: Layout, snap: torch.Tensor, digests: torch.Tensor, n: int) -> BucketScan:
    """`scan` on the CPU kernel of a bucket in (member, HF) order with nothing owed, its bookkeeping in
    numpy: a plain tensor is a bucket of one, so these microseconds are paid per tensor."""
    cur, snap_bits, tables = layout.kernel_args(snap)
    pos, hf, old, new, _, sums = scan_kernel.scan_bits(
        cur, snap_bits, tables, n, False, *_kernel_workers(), layout.buffers
    )
    sums = sums.view(np.int64)  # int64 wraps mod 2^64 as the torch path's sums do
    pre, post = sums[:, :2], sums[:, 2:]
    digest = digests.numpy() - pre + post
    counts = np.array([pos.size])
    if n > 1:  # changes per member, from the sorted offsets and the run bounds
        starts, ends, _, segs = tables
        counts = np.zeros(n, np.int64)
        np.add.at(counts, segs, np.searchsorted(pos, ends) - np.searchsorted(pos, starts))
    summary = torch.from_numpy(
        np.concatenate([digest.reshape(-1), pre.reshape(-1), post.reshape(-1), counts, counts])
    )
    dtype, pos_t = layout.base.dtype, torch.from_numpy(pos)
    new_t, old_t, hf_t = values(new, dtype), values(old, dtype), pos_t if hf is pos else torch.from_numpy(hf)
    return BucketScan(pos_t, new_t, hf_t, new_t, old_t, torch.from_numpy(digest), summary)


def _kernel_workers() -> tuple[int, Executor | None]:
    """The CPU kernel's windows and their pool: one per torch thread, and no pool on one."""
    workers = torch.get_num_threads() if _CPUS != 1 else 1
    return workers, _cpu_pool() if workers > 1 else None


def torch_diff_digest(
    layout: Layout, tables: tuple[torch.Tensor, ...], snap: torch.Tensor, n: int
) -> tuple[torch.Tensor, ...]:
    """(offsets, old, new, HF positions, runs, pre, post) of the changes in torch ops (kernel reference)."""
    pos, old, new = chunked_diff(layout.base, snap, DEVICE_CHUNK)
    seg, hf, keep, run = _map(layout, tables, pos)
    # drop changes no member covers (one check first: gathering six arrays costs more; meta can't say)
    if layout.gaps and (pos.device.type == "meta" or not bool(keep.all())):
        idx = torch.nonzero(keep).reshape(-1)
        pos, old, new, seg, hf, run = pos[idx], old[idx], new[idx], seg[idx], hf[idx], run[idx]
    seg = 0 if seg is None else seg  # one run: one member
    return pos, old, new, hf, run, segment_sums(hf, old, seg, n), segment_sums(hf, new, seg, n)


def chunked_diff(
    base: torch.Tensor, snap: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(changed offsets, snapshot values there, live values there), all where `snap` lives, a chunk at a
    time: bounded temporaries, a fixed number of ops per chunk (on the CPU it chunks and threads within)."""
    parts = []
    for a in range(0, snap.numel(), chunk):
        cur, s = base[a : a + chunk], snap[a : a + chunk]
        if cur.device != s.device:  # host snapshot: the live chunk comes over, nothing goes to the device
            cur = cur.to(s.device)
        p = changed_positions(cur, s)
        parts.append((p + a, s.index_select(0, p), cur.index_select(0, p)))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(x) for x in zip(*parts))  # type: ignore[return-value]


def locate(
    tables: tuple[torch.Tensor, ...], pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(member, HF position, covered?, run) of bucket offsets: one `searchsorted` over the run starts."""
    start, end, shift, seg, _ = tables
    r = (torch.searchsorted(start, pos, right=True) - 1).clamp_(min=0)
    return seg[r], pos + shift[r], pos < end[r], r


def _map(
    layout: Layout, tables: tuple[torch.Tensor, ...], pos: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`locate`, or for a bucket of one run (or `to_global`) just an offset (`seg` None: one member)."""
    if layout.to_global is not None:
        return None, layout.to_global(pos), None, None
    if len(layout.rows) == 1:
        start, hf, _, _ = layout.rows[0]
        return None, pos + (hf - start) if hf != start else pos, None, None
    return locate(tables, pos)


def count(tables: tuple[torch.Tensor, ...], n: int, pos: torch.Tensor) -> torch.Tensor:
    """Positions per member: `pos` is sorted and inside the runs, so two `searchsorted`s per run."""
    if tables[0].numel() == 1:  # one run: a plain tensor or a whole param
        return pos.new_full((1,), pos.numel())
    start, end, _, run_seg, _ = tables
    per_run = torch.searchsorted(pos, end) - torch.searchsorted(pos, start)
    return torch.zeros(n, dtype=torch.int64, device=pos.device).index_add_(0, run_seg, per_run)


def union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted union of two sets of positions, with ops every device has (no `unique` on meta)."""
    merged = torch.cat([a, b.to(a.device)]).sort().values
    keep = torch.ones_like(merged, dtype=torch.bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]
