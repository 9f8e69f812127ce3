"""The bucket scan's diff, gather, HF map and additive digests fused into one pass over CPU weights
(`scan_jit`), tested equal to `bucket_scan.torch_diff_digest` (6-7x slower, docs/results/kernels.md).
Other widths than 16 and 32 bits, off the CPU or with the kernels off (`switch.on`): the torch path."""

from __future__ import annotations

import sys
import weakref
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import torch

from vllm_delta.kernels import switch
from vllm_delta.kernels.digest import bits

Set = list[np.ndarray]  # offsets, HF positions, old bits, new bits, runs: `scan_jit.outputs`


def applies(base: torch.Tensor, snap: torch.Tensor) -> bool:
    """The kernel takes contiguous CPU spans of 16- and 32-bit dtypes (the widths it is tested on)."""
    same = base.dtype == snap.dtype and base.numel() == snap.numel() and not base.is_complex()
    cpu = base.device.type == snap.device.type == "cpu" and base.is_contiguous() and snap.is_contiguous()
    return switch.on() and same and cpu and base.element_size() in (2, 4)


def diff_digest(
    base: torch.Tensor, snap: torch.Tensor, tables: tuple, n: int, want_run: bool, *scan: Any
) -> tuple[torch.Tensor | None, ...]:
    """`scan_bits` (`scan`: its workers, pool, buffers) as `bucket_scan.torch_diff_digest` gives it: (offsets,
    old, new, HF positions, runs or None, pre [n, 2], post [n, 2]) of `base` against `snap`, as tensors."""
    pos, hf, old, new, run, sums = scan_bits(bits(base), bits(snap), numpy_tables(tables), n, want_run, *scan)
    pos_t, sums_t = torch.from_numpy(pos), torch.from_numpy(sums.view(np.int64))
    hf_t, run_t = pos_t if hf is pos else torch.from_numpy(hf), torch.from_numpy(run) if want_run else None
    pre, post = sums_t[:, :2].contiguous(), sums_t[:, 2:].contiguous()
    return pos_t, values(old, base.dtype), values(new, base.dtype), hf_t, run_t, pre, post


def scan_bits(
    cur: np.ndarray,
    old_bits: np.ndarray,
    tables: tuple[np.ndarray, ...],
    n: int,
    want_run: bool,
    workers: int = 1,
    pool: Executor | None = None,
    buffers: ScanBuffers | None = None,
) -> tuple[np.ndarray, ...]:
    """(offsets, HF positions, old bits, new bits, runs, sums [n, 4]: pre, post) of `cur` against `old_bits`
    in the runs, in `workers` windows; numpy, as a tensor op's ~1 us a tensor adds up over small tensors."""
    from vllm_delta.kernels.scan_jit import CHUNK, capacity, outputs, scan_runs

    starts, ends, shifts, segs = tables
    windows = _windows(cur.size, workers if pool is not None else 1, CHUNK)
    if buffers is None:
        sets = [outputs(capacity(a, b), cur, want_run) for a, b in windows]
    else:
        sets = buffers.take(windows, cur, want_run)
    same_hf = starts.size == 1 and shifts[0] == 0
    args = (cur, old_bits, starts, ends, shifts, segs)
    if len(windows) == 1:
        parts = [scan_runs(*args, windows[0][0], windows[0][1], n, want_run, same_hf, *sets[0])]
    else:
        assert pool is not None  # several windows only with a pool
        futures: list[Future] = [
            pool.submit(scan_runs, *args, a, b, n, want_run, same_hf, *s) for (a, b), s in zip(windows, sets)
        ]
        parts = [f.result() for f in futures]
    if buffers is not None:
        buffers.settle([(p[0], p[1:6]) for p in parts])
    if len(parts) == 1:
        k, pos, hf, old, new, run, sums = parts[0]
        pos, old, new, run = pos[:k], old[:k], new[:k], run[:k] if want_run else run
        return pos, pos if same_hf else hf[:k], old, new, run, sums
    pos, hf, old, new, run = (np.concatenate([p[i][: p[0]] for p in parts]) for i in range(1, 6))
    sums = sum((p[6] for p in parts[1:]), parts[0][6])  # uint64: wraps mod 2^64 as the torch path's int64
    return pos, pos if same_hf else hf, old, new, run, sums


def numpy_tables(tables: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
    """The run table's start, end, HF shift and member columns as the kernel takes them (CPU, no copy)."""
    return tuple(t.numpy() for t in tables[:4])


def values(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Bits from the kernel as a `dtype` tensor (no copy)."""
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[a.itemsize]
    return torch.from_numpy(a.view(signed)).view(dtype)


def _windows(numel: int, workers: int, chunk: int) -> list[tuple[int, int]]:
    """One window per worker, at least a few chunks each; a single window when that is all there is."""
    k = max(1, min(workers, numel // (64 * chunk)))
    step = -(-numel // k)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, 0)]


_ALONE = [sys.getrefcount(a) for a in [np.empty(0)]][0]  # an array only a list holds, counted as in `alone`


def alone(arrays: Set) -> bool:
    """Nothing but the list `arrays` holds any of them (strongly or weakly)."""
    held = max([sys.getrefcount(a) for a in arrays])
    return held <= _ALONE and not any(weakref.getweakrefcount(a) for a in arrays)


class ScanBuffers:
    """The scan's output sets, reused from one scan of a bucket to the next once reference counts show only
    this pool holds them (fresh arrays page-fault on every page written: a third of a 1 GB scan,
    docs/results/sender.md). Per window at most the last scan's set and the one before, if still held."""

    def __init__(self) -> None:
        self._sets: dict[tuple, list[Set]] = {}
        self._taken: dict[tuple, Set] = {}  # the last `take`'s, by window
        self.allocated = 0  # sets made fresh (the rest were reused): what tests count

    def take(self, windows: list[tuple[int, int]], like: np.ndarray, want_run: bool) -> list[Set]:
        """A set per window of this scan: a pooled one nothing else holds, else a fresh one."""
        from vllm_delta.kernels.scan_jit import capacity, outputs

        self._taken = {}
        for lo, hi in windows:
            key = (lo, hi, like.dtype, want_run)
            sets = self._sets.setdefault(key, [])
            i = next((i for i, s in enumerate(sets) if alone(s)), None)
            if i is None:
                free = list(outputs(capacity(lo, hi), like, want_run))
                self.allocated += 1
            else:
                free = sets.pop(i)  # by index: `==` on lists of arrays compares their elements
            sets.append(free)
            self._taken[key] = free
        return list(self._taken.values())

    def settle(self, written: list[tuple[int, Set]]) -> None:
        """After a scan, `written` (changes, arrays returned) per set of the last `take`: a grown set replaces
        its own, one over twice its changes goes, as do windows not taken and older sets but the last held."""
        from vllm_delta.kernels.scan_jit import capacity

        kept = {}
        for (key, taken), (k, out) in zip(self._taken.items(), written):
            older = [s for s in self._sets[key][:-1] if not alone(s)][-1:]
            grown = out[0] is not taken[0]
            last = list(out) if grown else taken
            small = last[0].size <= max(capacity(key[0], key[1]), 2 * k)
            kept[key] = older + ([last] if small else [])
        self._sets, self._taken = kept, {}
