"""The bucket scan's diff, gather, HF map and additive digests fused into one pass, for CPU weights.

Why: the torch/numpy path (`bucket_scan.torch_diff_digest`, the reference this is tested equal
to) makes a mask, its nonzero, two gathers, the HF map and ~30 elementwise int64 passes for the
digest terms: 10-12x a memcpy of the weights on one CPU thread. This kernel reads each side once
(xor of a small chunk into an L1 scratch, then a word-wise skip of the unchanged elements) and, per
change, writes its offset, HF position, old and new bits and adds its four digest terms
(`wire.additive`: key = HF position << width | bits, splitmix64 / fmix64 lanes, uint64 wrapping
sums) to its member's row. Elements no run covers (padding, unregistered params) are never
looked at, which is the torch path's "drop uncovered changes".

numba is optional: without it (or for a dtype wider than 32 bits, or off the CPU) the torch path
runs. `VLLM_DELTA_SCAN_KERNEL=0` forces the torch path (A/B runs, tests).
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future

import numpy as np
import torch

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is the `cpu-scan` extra (and a vLLM dependency)
    njit = None

# Elements xored into the scratch at a time: two 4 KiB reads and a 4 KiB write stay in L1.
CHUNK = 2048
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_M1_0, _M2_0 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 (lane 0)
_K_1 = np.uint64(0xC2B2AE3D27D4EB4F)  # lane 1's key is XORed with this first (wire.additive._LANES)
_M1_1, _M2_1 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # Murmur3 fmix64 (lane 1)


def enabled() -> bool:
    """numba importable and not switched off by the environment."""
    return njit is not None and os.environ.get("VLLM_DELTA_SCAN_KERNEL", "1") != "0"


def applies(base: torch.Tensor, snap: torch.Tensor) -> bool:
    """The kernel takes contiguous CPU spans of dtypes up to 32 bits (their digest key is
    position << width | bits); anything else goes the torch way."""
    return (enabled() and base.device.type == "cpu" and snap.device.type == "cpu"
            and base.element_size() in _UINT and base.dtype == snap.dtype and not base.is_complex()
            and base.is_contiguous() and snap.is_contiguous() and base.numel() == snap.numel())


if njit is not None:
    @njit(nogil=True, cache=True)
    def _lane0(x):  # splitmix64's finaliser; additive._mix_ with _LANES[0]
        x ^= x >> np.uint64(30)
        x *= _M1_0
        x ^= x >> np.uint64(27)
        x *= _M2_0
        return x ^ (x >> np.uint64(31))

    @njit(nogil=True, cache=True)
    def _lane1(x):  # Murmur3's fmix64 of the key XOR its first constant; additive._mix_ with _LANES[1]
        x ^= _K_1
        x ^= x >> np.uint64(33)
        x *= _M1_1
        x ^= x >> np.uint64(33)
        x *= _M2_1
        return x ^ (x >> np.uint64(33))

    @njit(nogil=True, cache=True)
    def _grow(a, n):
        b = np.empty(2 * a.size, a.dtype)
        b[:n] = a[:n]
        return b

    @njit(nogil=True, cache=True)
    def _scan(cur, snap, starts, ends, shifts, segs, lo, hi, nseg, want_run):
        """Changes of `cur` vs `snap` inside the runs, clipped to [lo, hi): (count, offsets, HF
        positions, old bits, new bits, runs, sums[nseg, 4] = pre lane 0, pre lane 1, post 0, post 1).
        Per chunk: xor into the scratch (vectorised), the changed elements' indices from the
        nonzero words (branch-free within a word), then their outputs and digest terms."""
        width = np.uint64(8 * cur.itemsize)
        per = 8 // cur.itemsize  # elements per 64-bit word of the scratch
        cap = max(CHUNK, (hi - lo) >> 5)
        pos = np.empty(cap, np.int64)
        hfs = np.empty(cap, np.int64)
        old = np.empty(cap, cur.dtype)
        new = np.empty(cap, cur.dtype)
        run = np.empty(cap if want_run else 1, np.int64)
        sums = np.zeros((nseg, 4), np.uint64)
        d = np.zeros(CHUNK, cur.dtype)
        words = d.view(np.uint64)
        at = np.empty(CHUNK, np.int64)  # a chunk's changed indices
        k = 0
        for r in range(starts.size):
            a, e = max(starts[r], lo), min(ends[r], hi)
            shift = shifts[r]
            pre0, pre1, post0, post1 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
            for c in range(a, e, CHUNK):
                m = min(CHUNK, e - c)
                x, y = cur[c:c + m], snap[c:c + m]  # local views: the loop vectorises
                for i in range(m):
                    d[i] = x[i] ^ y[i]
                nw = (m + per - 1) // per
                for i in range(m, nw * per):  # the last word's tail past the run: no change
                    d[i] = 0
                found = 0
                for j in range(nw):
                    if words[j] != 0:
                        for i in range(j * per, j * per + per):
                            at[found] = i
                            found += d[i] != 0
                if k + found > pos.size:
                    pos, hfs, old, new = _grow(pos, k), _grow(hfs, k), _grow(old, k), _grow(new, k)
                    if want_run:
                        run = _grow(run, k)
                for t in range(found):
                    i = at[t]
                    p = c + i
                    h = p + shift
                    ov, nv = y[i], x[i]
                    pos[k + t], hfs[k + t], old[k + t], new[k + t] = p, h, ov, nv
                    key = np.uint64(h) << width
                    ko, kn = key | np.uint64(ov), key | np.uint64(nv)
                    pre0 += _lane0(ko)
                    pre1 += _lane1(ko)
                    post0 += _lane0(kn)
                    post1 += _lane1(kn)
                if want_run:
                    run[k:k + found] = r
                k += found
            s = segs[r]
            sums[s, 0] += pre0
            sums[s, 1] += pre1
            sums[s, 2] += post0
            sums[s, 3] += post1
        return k, pos, hfs, old, new, run, sums


def diff_digest(base: torch.Tensor, snap: torch.Tensor, tables: tuple[torch.Tensor, ...], n: int,
                want_run: bool, workers: int = 1, pool: Executor | None = None) -> tuple[torch.Tensor | None, ...]:
    """(offsets, old, new, HF positions, runs or None, pre [n, 2], post [n, 2]) of the changes of the
    bucket span `base` against `snap` inside the run `tables` (`bucket_scan.run_tables`), as
    `bucket_scan.torch_diff_digest` gives them. With a pool, the span is cut into `workers` windows."""
    u = _UINT[base.element_size()]
    cur, old_np = _bits(base, u), _bits(snap, u)
    starts, ends, shifts, segs = (t.numpy() for t in tables[:4])
    windows = _windows(base.numel(), workers if pool is not None else 1)
    args = (cur, old_np, starts, ends, shifts, segs)
    if len(windows) == 1:
        parts = [_scan(*args, windows[0][0], windows[0][1], n, want_run)]
    else:
        futures: list[Future] = [pool.submit(_scan, *args, a, b, n, want_run) for a, b in windows]
        parts = [f.result() for f in futures]
    pieces = [tuple(x[:p[0]] for x in p[1:6]) for p in parts]
    pos, hf, old, new, run = (np.concatenate(x) if len(x) > 1 else x[0] for x in zip(*pieces))
    sums = parts[0][6]
    for p in parts[1:]:
        sums = sums + p[6]  # uint64: wraps mod 2^64, as the torch path's int64 sums do
    sums = torch.from_numpy(sums.view(np.int64))
    dtype = base.dtype
    return (torch.from_numpy(pos), _values(old, dtype), _values(new, dtype), torch.from_numpy(hf),
            torch.from_numpy(run) if want_run else None, sums[:, :2].contiguous(), sums[:, 2:].contiguous())


def _bits(t: torch.Tensor, u: type) -> np.ndarray:
    """The tensor's bits as an unsigned numpy view (no copy)."""
    return t.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
                                       ).numpy().view(u)


def _values(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[a.itemsize]
    return torch.from_numpy(a.view(signed)).view(dtype)


def _windows(numel: int, workers: int) -> list[tuple[int, int]]:
    """One window per worker, at least a few chunks each; a single window when that is all there is."""
    k = max(1, min(workers, numel // (64 * CHUNK)))
    step = -(-numel // k)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, 0)]
