"""`ulp_zstd`'s value streams of a block in one pass (`wire.codecs.ulp_streams`' kernel), tested
byte-equal to the numpy codecs; flat loops over native widths, so that LLVM vectorises them."""

from __future__ import annotations

import numpy as np

from vllm_delta.kernels.switch import kernel


@kernel
def _steps(new, old, neg, big, mag):
    """Per change the float order keys' wrapping step (`codecs.order_key`, `ulp_steps`): its sign,
    `|step| > 1`, and |step| (the most negative step maps to itself), in the values' own width."""
    top = new.dtype.type(8 * new.itemsize - 1)
    sb = new.dtype.type(1) << top
    zero, one = new.dtype.type(0), new.dtype.type(1)
    for k in range(new.size):
        bn, bo = new[k], old[k]
        kn = bn ^ (sb | (zero - (bn >> top)))  # negatives: every bit flipped; positives: the sign bit set
        ko = bo ^ (sb | (zero - (bo >> top)))
        step = new.dtype.type(kn - ko)
        s = step >> top
        mag[k] = new.dtype.type((step ^ (zero - s)) + s)
        neg[k] = s
        big[k] = mag[k] > one


@kernel
def _pack(flags, out):
    """`np.packbits` of 0/1 bytes: first entry in the high bit, the last byte zero-padded."""
    n = flags.size
    for i in range(n // 8):
        b = 0
        for j in range(8):
            b |= flags[8 * i + j] << (7 - j)
        out[i] = b
    if n % 8:
        b = 0
        for j in range(n % 8):
            b |= flags[n - n % 8 + j] << (7 - j)
        out[n // 8] = b


@kernel
def write_ulp_streams(new, old, sign, flag, esc):
    """`encode_steps(ulp_steps(new, old))` of float bits: packed signs and flags into `sign` and
    `flag`, the flagged steps' |step| - 2 as byte planes esc[j, :count]; returns count."""
    n = new.size
    neg, big = np.empty(n, np.uint8), np.empty(n, np.uint8)
    mag = np.empty(n, new.dtype)
    _steps(new, old, neg, big, mag)
    _pack(neg, sign)
    _pack(big, flag)
    two = new.dtype.type(2)
    count = 0
    b = mag.view(np.uint8)
    w = new.itemsize
    for k in range(n):
        if big[k]:
            e = new.dtype.type(mag[k] - two)
            mag[k] = e
            for j in range(w):
                esc[j, count] = b[k * w + j]
            count += 1
    return count
