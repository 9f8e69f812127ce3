"""The numba scan of a block-indexed flush's `params` JSON, tested equal to `flush_meta.parse_params`: only
the exact ASCII the writer's `json.dumps` writes; for anything else -1 (the caller parses the JSON)."""

from __future__ import annotations

import numpy as np

from vllm_delta.kernels.switch import kernel

# The keys of an entry, in the writer's order, with what precedes each (`scan`'s `keys`).
KEYS = tuple(
    np.frombuffer(k.encode(), dtype=np.uint8)
    for k in ('{"name":', ',"dtype":', ',"shape":', ',"count":', ',"width":', ',"streams":', ',"blocks":')
)
# Per param, the columns of `scan`'s `spans` output; the ids are of `scan`'s `distinct` texts.
NAME_A, NAME_B, DTYPE, SHAPE, COUNT, WIDTH, STREAMS, NROWS = range(8)
MAX_DISTINCT = 2048  # distinct dtypes, shapes or stream lists a flush: past it, the JSON path reads it
_SLOTS = 2 * MAX_DISTINCT  # a power of two: the open-addressing tables' size
_QUOTE, _BACKSLASH, _COMMA, _LBRACKET, _RBRACKET, _LBRACE, _RBRACE = 34, 92, 44, 91, 93, 123, 125
_MAX_DIGITS = 18  # every such int fits int64; a longer one is the JSON parser's to read


# Each reader below answers -1 (a failure) for a negative `at`, so a chain of them fails at its first.
@kernel
def _literal(buf, at, text):
    """The position after `text` when `buf` holds it at `at`, else -1."""
    if at < 0 or at + text.size > buf.size:
        return -1
    for k in range(text.size):
        if buf[at + k] != text[k]:
            return -1
    return at + text.size


@kernel
def _intern(buf, a, b, slots, distinct, n, field):
    """The id of the text buf[a:b] among field `field`'s distinct texts (added where new), or -1 past
    MAX_DISTINCT. `slots[field]` is an open-addressing table of ids by FNV-1a hash of the bytes."""
    h = np.uint64(14695981039346656037)
    for i in range(a, b):
        h = (h ^ np.uint64(buf[i])) * np.uint64(1099511628211)
    j = np.int64(h & np.uint64(_SLOTS - 1))
    while True:
        k = slots[field, j]
        if k < 0:
            if n[field] >= MAX_DISTINCT:
                return -1
            k = n[field]
            distinct[field, k, 0], distinct[field, k, 1] = a, b
            slots[field, j] = k
            n[field] += 1
            return k
        da, db = distinct[field, k, 0], distinct[field, k, 1]
        if db - da == b - a and _literal(buf, a, buf[da:db]) >= 0:  # the same text
            return k
        j = (j + 1) & (_SLOTS - 1)


@kernel
def _byte(buf, at, c):
    """The position after byte `c` at `at`, else -1."""
    return at + 1 if 0 <= at < buf.size and buf[at] == c else -1


@kernel
def _string(buf, at):
    """The end (its closing quote) of a JSON string opening at `at` with no escape, no control byte
    and no byte past ASCII, else -1."""
    if at < 0 or at >= buf.size or buf[at] != _QUOTE:
        return -1
    i = at + 1
    while i < buf.size:
        c = buf[i]
        if c == _QUOTE:
            return i
        if c == _BACKSLASH or c < 32 or c > 127:
            return -1
        i += 1
    return -1


@kernel
def _int(buf, at, out, k):
    """A JSON int of at most _MAX_DIGITS digits at `at` into out[k]: the position after it, else -1."""
    i = at if at >= 0 else buf.size  # a failure passed on: no digits
    neg = i < buf.size and buf[i] == 45  # '-'
    if neg:
        i += 1
    start = i
    value = 0
    while i < buf.size and 48 <= buf[i] <= 57:
        value = value * 10 + (np.int64(buf[i]) - 48)
        i += 1
    digits = i - start
    if digits == 0 or digits > _MAX_DIGITS or (digits > 1 and buf[start] == 48):
        return -1
    out[k] = -value if neg else value
    return i


@kernel
def _ints(buf, at, out, k):
    """A JSON list of ints at `at` into out[k:]: (the position after it, how many), else (-1, 0)."""
    i = _byte(buf, at, _LBRACKET)
    if 0 <= i < buf.size and buf[i] == _RBRACKET:
        return i + 1, 0
    n = 0
    while i >= 0 and k + n < out.size:
        i = _int(buf, i, out, k + n)
        n += 1
        if 0 <= i < buf.size and buf[i] == _RBRACKET:
            return i + 1, n
        i = _byte(buf, i, _COMMA)
    return -1, 0


@kernel
def _strings(buf, at):
    """The position after a JSON list of strings (as `_string` takes them) at `at`, else -1."""
    i = _byte(buf, at, _LBRACKET)
    if 0 <= i < buf.size and buf[i] == _RBRACKET:
        return i + 1
    while i >= 0:
        end = _string(buf, i)
        if end >= 0 and end + 1 < buf.size and buf[end + 1] == _RBRACKET:
            return end + 2
        i = _byte(buf, end + 1, _COMMA) if end >= 0 else -1
    return -1


@kernel
def scan(buf, keys):
    """(params, rows, frames, spans, distinct, counts, heads, frame_at, lens) of the params JSON in `buf`, or
    params -1: per param its name's span and its dtype, shape and streams as ids of `distinct`' spans; per
    block row first, last, count and where its frame lengths start in `lens` (the first rows/frames)."""
    n_max = buf.size // 60 + 1
    r_max = buf.size // 10 + 1
    spans = np.empty((n_max, 8), dtype=np.int64)
    slots = np.full((3, _SLOTS), -1, dtype=np.int64)
    distinct = np.empty((3, MAX_DISTINCT, 2), dtype=np.int64)
    counts = np.zeros(3, dtype=np.int64)
    heads = np.empty((r_max, 3), dtype=np.int64)
    frame_at = np.empty(r_max + 1, dtype=np.int64)
    lens = np.empty(buf.size // 2 + 1, dtype=np.int64)
    fail = (-1, 0, 0, spans, distinct, counts, heads, frame_at, lens)
    if buf.size < 2 or buf[0] != _LBRACKET:
        return fail
    i, p, r, f = 1, 0, 0, 0
    while True:
        if p >= n_max:
            return fail
        row = spans[p]
        i = _literal(buf, i, keys[0])
        end = _string(buf, i)
        if end < 0:
            return fail
        row[NAME_A], row[NAME_B] = i + 1, end
        i = _literal(buf, end + 1, keys[1])
        end = _string(buf, i)
        if end < 0:
            return fail
        row[DTYPE] = _intern(buf, i + 1, end, slots, distinct, counts, 0)
        at = _literal(buf, end + 1, keys[2])
        i, _ = _ints(buf, at, lens, f)  # checked here, read from its text by the caller (`lens` reused)
        if i < 0 or row[DTYPE] < 0:
            return fail
        row[SHAPE] = _intern(buf, at, i, slots, distinct, counts, 1)
        i = _int(buf, _literal(buf, i, keys[3]), row, COUNT)
        i = _int(buf, _literal(buf, i, keys[4]), row, WIDTH)
        at = _literal(buf, i, keys[5])
        i = _strings(buf, at)
        if i < 0 or row[SHAPE] < 0:
            return fail
        row[STREAMS] = _intern(buf, at, i, slots, distinct, counts, 2)
        i = _byte(buf, _literal(buf, i, keys[6]), _LBRACKET)
        if row[STREAMS] < 0 or i < 0:
            return fail
        rows = 0
        if i < buf.size and buf[i] == _RBRACKET:
            i += 1
        else:
            while True:  # [first, last, count, [frame lengths]]
                if r >= r_max:
                    return fail
                i = _byte(buf, i, _LBRACKET)
                for k in range(3):
                    i = _byte(buf, _int(buf, i, heads[r], k), _COMMA)
                frame_at[r] = f
                i, got = _ints(buf, i, lens, f)
                i = _byte(buf, i, _RBRACKET)
                if i < 0 or i >= buf.size:
                    return fail
                f += got
                r += 1
                rows += 1
                if buf[i] == _RBRACKET:
                    i += 1
                    break
                i = _byte(buf, i, _COMMA)
        row[NROWS] = rows
        i = _byte(buf, i, _RBRACE)
        if i < 0 or i >= buf.size:
            return fail
        p += 1
        if buf[i] == _RBRACKET:
            if i + 1 != buf.size:
                return fail
            frame_at[r] = f
            return p, r, f, spans, distinct, counts, heads, frame_at, lens
        i = _byte(buf, i, _COMMA)
