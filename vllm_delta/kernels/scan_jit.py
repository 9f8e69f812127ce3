"""The numba kernels of `scan`: per chunk of a run, the changed elements' indices, branch-free (at 2 %
density a branch mispredicts on every change), then per change its outputs; per run the digest terms of
each change's old and new bits (`digest_jit.range_sums`), added to the run's member."""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic

from vllm_delta.kernels.digest_jit import range_sums
from vllm_delta.kernels.switch import kernel

# Elements of a run taken at a time: their changed indices (int32, 8 KiB at most) stay in L1.
CHUNK = 2048


def _compress_store() -> bool:
    """Whether the CPU numba compiles for has AVX-512's compress store (numba's cache is keyed by
    that CPU, so a cached kernel always matches this choice)."""
    if config.CPU_FEATURES is not None:  # NUMBA_CPU_FEATURES: a target other than this host
        return "+avx512f" in config.CPU_FEATURES
    return bool(llvm.get_host_cpu_features().get("avx512f"))


COMPRESS = _compress_store()


def capacity(lo: int, hi: int) -> int:
    """Changes the output arrays of a window [lo, hi) hold before the kernel grows them: 1/32 of
    its elements (3.1% density), at least a chunk's. Virtual memory: pages become resident as written."""
    return max(CHUNK, (hi - lo) >> 5)


@kernel
def outputs(cap, like, want_run):
    """Fresh output arrays for `scan_runs` (offsets, HF positions, old bits, new bits, runs), from
    numba's allocator (malloc: no transparent-huge-page advice, whose compaction stalls cost more)."""
    return (
        np.empty(cap, np.int64),
        np.empty(cap, np.int64),
        np.empty(cap, like.dtype),
        np.empty(cap, like.dtype),
        np.empty(cap if want_run else 1, np.int64),
    )


@kernel
def _grow(a, n):
    b = np.empty(2 * a.size, a.dtype)
    b[:n] = a[:n]
    return b


@intrinsic
def _changed16(typingctx, x, y, start, out, at):
    """The lanes `i` where x[start + i] != y[start + i], as int32 `start + i` at out[at:]; how many. AVX-512:
    `vpcompressd` into a register, then a 16-lane store (the memory form is microcoded on AMD Zen 4)."""
    sig = types.int64(x, y, types.int64, out, types.int64)

    def codegen(context, builder, signature, args):
        xs, ys, st, os_, at_ = args
        bits = signature.args[0].dtype.bitwidth
        xd = context.make_array(signature.args[0])(context, builder, xs).data
        yd = context.make_array(signature.args[1])(context, builder, ys).data
        od = context.make_array(signature.args[3])(context, builder, os_).data
        lanes, i32 = ir.VectorType(ir.IntType(bits), 16), ir.IntType(32)
        v32, mask_t = ir.VectorType(i32, 16), ir.VectorType(ir.IntType(1), 16)
        xv = builder.load(builder.bitcast(builder.gep(xd, [st]), lanes.as_pointer()), align=bits // 8)
        yv = builder.load(builder.bitcast(builder.gep(yd, [st]), lanes.as_pointer()), align=bits // 8)
        mask = builder.icmp_unsigned("!=", xv, yv)
        undef = ir.Constant(v32, ir.Undefined)
        first = builder.insert_element(undef, builder.trunc(st, i32), ir.Constant(i32, 0))
        splat = builder.shuffle_vector(first, undef, ir.Constant(v32, [0] * 16))
        idx = builder.add(splat, ir.Constant(v32, list(range(16))))  # start + lane
        mod = builder.module
        dest = builder.bitcast(builder.gep(od, [at_]), i32.as_pointer())
        name = "llvm.x86.avx512.mask.compress.v16i32"  # in a register, then one 64-byte store
        comp = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(v32, [v32, v32, mask_t]), name)
        packed = builder.call(comp, [idx, undef, mask])
        builder.store(packed, builder.bitcast(dest, v32.as_pointer()), align=4)
        i16, name = ir.IntType(16), "llvm.ctpop.i16"
        pop = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(i16, [i16]), name)
        return builder.zext(builder.call(pop, [builder.bitcast(mask, i16)]), ir.IntType(64))

    return sig, codegen


@kernel
def find_compress(x, y, at):
    """How many indices where x != y, into `at`, 16 lanes at a time, each store inside at[:x.size]. AVX-512
    only (`COMPRESS`): LLVM's generic compress store is scalar, ~2x slower than `find_words`."""
    m = x.size
    m16 = m - m % 16
    found = 0
    for i in range(0, m16, 16):
        found += _changed16(x, y, i, at, found)
    for i in range(m16, m):
        at[found] = i
        found += x[i] != y[i]
    return found


@kernel
def find_words(x, y, at, d, words):
    """`find_compress` for CPUs without AVX-512: xor into the scratch `d` (vectorised), skip its zero
    64-bit `words`, branch-free within one."""
    m = x.size
    per = 8 // x.itemsize
    for i in range(m):
        d[i] = x[i] ^ y[i]
    nw = (m + per - 1) // per
    for i in range(m, nw * per):  # the last word's tail past the chunk: no change
        d[i] = 0
    found = 0
    for j in range(nw):
        if words[j] != 0:
            for i in range(j * per, j * per + per):
                at[found] = i
                found += d[i] != 0
    return found


@kernel
def scan_runs(
    cur, snap, starts, ends, shifts, segs, lo, hi, nseg, want_run, same_hf, pos, hfs, old, new, run
):
    """Changes of `cur` vs `snap` inside the runs, clipped to [lo, hi): (count, offsets, HF positions, old
    bits, new bits, runs, sums[nseg, 4]), into `pos`..`run` or, past their size, grown copies. `same_hf`
    (a plain tensor): `hfs` is left unwritten, the offsets stand for both. The digest terms are summed
    per run in a loop of their own (`range_sums`), which LLVM vectorises."""
    sums = np.zeros((nseg, 4), np.uint64)
    at = np.empty(CHUNK, np.int32)  # a chunk's changed indices
    d = np.zeros(CHUNK, cur.dtype)  # find_words' scratch
    words = d.view(np.uint64)
    k = 0
    for r in range(starts.size):
        a, e = max(starts[r], lo), min(ends[r], hi)
        shift = shifts[r]
        k0 = k
        for c in range(a, e, CHUNK):
            m = min(CHUNK, e - c)
            x, y = cur[c : c + m], snap[c : c + m]
            found = find_compress(x, y, at) if COMPRESS else find_words(x, y, at, d, words)
            if k + found > pos.size:
                pos, hfs, old, new = _grow(pos, k), _grow(hfs, k), _grow(old, k), _grow(new, k)
                if want_run:
                    run = _grow(run, k)
            for t in range(found):
                i = at[t]
                pos[k + t], old[k + t], new[k + t] = c + i, y[i], x[i]
            if not same_hf:
                for t in range(k, k + found):
                    hfs[t] = pos[t] + shift
            if want_run:
                run[k : k + found] = r
            k += found
        hf = pos if same_hf else hfs
        pre0, pre1 = range_sums(hf, old, k0, k)
        post0, post1 = range_sums(hf, new, k0, k)
        s = segs[r]
        sums[s, 0] += pre0
        sums[s, 1] += pre1
        sums[s, 2] += post0
        sums[s, 3] += post1
    return k, pos, hfs, old, new, run, sums
