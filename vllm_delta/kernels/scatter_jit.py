"""The numba kernels of `scatter`, on bit patterns as unsigned ints, with every offset checked against the
storage (numba would write outside it); the ULP resolve is `codecs.ulp_resolve`'s, branch-free."""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllm_delta.kernels.switch import kernel

# Entries ahead whose weights line each loop prefetches: offsets rise by ~100-400 B at 0.5-2% density,
# too irregular for the hardware prefetcher (on a 1 GB model, 30 -> 10 ns an entry at 0.5%).
AHEAD = 16
# How `resolve` maps bits to order keys (wire.codecs.order_key): floats, uint8 (identity), signed ints.
FLOAT, UNSIGNED, SIGNED = 0, 1, 2


@kernel
def _resolve(old, step, kind, top, full):
    """The value `step` order-key units from `old` (uint64 holding `top + 1` bits), wrapping in that width."""
    sb = np.uint64(1) << top
    if kind == FLOAT:  # negatives flip every bit, positives set the sign bit
        key = old ^ (((np.uint64(0) - (old >> top)) & full) | sb)
    elif kind == SIGNED:
        key = old ^ sb
    else:
        key = old
    key = (key + step) & full
    if kind == FLOAT:  # sign bit set: clear it; clear: flip every bit
        return key ^ (((key >> top) - np.uint64(1)) & full | sb)
    if kind == SIGNED:
        return key ^ sb
    return key


# The intrinsic's name carries its pointer type: opaque `ptr` from LLVM 17 (llvmlite >= 0.45), `i8*` before.
_PREFETCH = "llvm.prefetch.p0" if llvm.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Ask for the cache line of arr[idx] (`llvm.prefetch`, read, keep in all levels): a hint that
    never faults, so an index past the end is harmless."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        mod = builder.module
        fn = mod.globals.get(_PREFETCH) or ir.Function(
            mod, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), _PREFETCH
        )
        at = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [at, *(ir.Constant(i32, c) for c in (0, 3, 1))])  # read, keep in all levels, data
        return context.get_dummy_value()

    return sig, codegen


@kernel
def _check(offsets, n):
    """Every offset inside [0, n), in a pass of its own: the loops after it then carry no branch out
    and vectorise (a raise inside them kept them scalar)."""
    bad = False
    for i in range(offsets.size):
        o = offsets[i]
        bad |= (o < 0) | (o >= n)
    if bad:
        raise IndexError("a staged offset lies outside the destination's storage")


@kernel
def write(flat, offsets, values):
    """flat[offsets[i]] = values[i]: the plain chunk's scatter."""
    _check(offsets, flat.size)
    n = offsets.size
    for i in range(n):
        _prefetch(flat, offsets[min(i + AHEAD, n - 1)])  # clamped: offsets is read in bounds
        flat[offsets[i]] = values[i]


@kernel
def write_resolved(flat, offsets, steps, kind, out):
    """out[i] = the value `steps[i]` ULPs from flat[offsets[i]], written there: the ULP chunk's scatter."""
    _check(offsets, flat.size)
    top = np.uint64(8 * flat.itemsize - 1)
    full = (np.uint64(1) << top << np.uint64(1)) - np.uint64(1)
    n = offsets.size
    for i in range(n):
        _prefetch(flat, offsets[min(i + AHEAD, n - 1)])  # clamped: offsets is read in bounds
        o = offsets[i]
        v = _resolve(np.uint64(flat[o]), np.uint64(steps[i]), kind, top, full)
        out[i] = v
        flat[o] = v


@kernel
def mismatches(flat, offsets, values):
    """How many flat[offsets[i]] != values[i]: the read-back, a separate pass after the writes."""
    _check(offsets, flat.size)
    bad = 0
    n = offsets.size
    for i in range(n):
        _prefetch(flat, offsets[min(i + AHEAD, n - 1)])  # clamped: offsets is read in bounds
        bad += flat[offsets[i]] != values[i]
    return bad
