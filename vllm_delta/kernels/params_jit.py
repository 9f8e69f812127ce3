"""The numba scan of a block-indexed flush's `params` JSON (`heads_from_text`), tested equal to
`flush_meta.parse_params` (tests/wire/test_params_columns.py): only the exact ASCII bytes the writer's
`json.dumps(params, separators=(",", ":"))` writes; for anything else -1, and the caller parses the JSON."""

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
        if db - da == b - a:
            same = True
            for i in range(b - a):
                if buf[da + i] != buf[a + i]:
                    same = False
                    break
            if same:
                return k
        j = (j + 1) & (_SLOTS - 1)


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
    if at < 0 or at >= buf.size or buf[at] != _LBRACKET:
        return -1, 0
    i = at + 1
    n = 0
    if i < buf.size and buf[i] == _RBRACKET:
        return i + 1, 0
    while True:
        if k + n >= out.size:
            return -1, 0
        i = _int(buf, i, out, k + n)
        if i < 0 or i >= buf.size:
            return -1, 0
        n += 1
        if buf[i] == _RBRACKET:
            return i + 1, n
        if buf[i] != _COMMA:
            return -1, 0
        i += 1


@kernel
def _strings(buf, at):
    """The position after a JSON list of strings (as `_string` takes them) at `at`, else -1."""
    if at < 0 or at >= buf.size or buf[at] != _LBRACKET:
        return -1
    i = at + 1
    if i < buf.size and buf[i] == _RBRACKET:
        return i + 1
    while True:
        i = _string(buf, i)
        if i < 0 or i + 1 >= buf.size:
            return -1
        i += 1
        if buf[i] == _RBRACKET:
            return i + 1
        if buf[i] != _COMMA:
            return -1
        i += 1


@kernel
def scan(buf, keys):
    """(params, rows, frames, spans, distinct, counts, heads, frame_at, lens) of the params JSON in `buf`
    (`KEYS`), or params -1. Per param, `spans`: its name's span and its dtype, shape and streams as ids of
    `distinct[0..2]`' spans (`counts` of each). Per block row, `heads`: first, last, count, and
    `frame_at`: where its frame lengths start in `lens`. Only the first params/rows/frames are meant."""
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
        i = _literal(buf, i, keys[6])
        if row[STREAMS] < 0 or i < 0 or i >= buf.size or buf[i] != _LBRACKET:
            return fail
        i += 1
        rows = 0
        if i < buf.size and buf[i] == _RBRACKET:
            i += 1
        else:
            while True:  # [first, last, count, [frame lengths]]
                if r >= r_max or i >= buf.size or buf[i] != _LBRACKET:
                    return fail
                i += 1
                for k in range(3):
                    i = _int(buf, i, heads[r], k)
                    if i < 0 or i >= buf.size or buf[i] != _COMMA:
                        return fail
                    i += 1
                frame_at[r] = f
                i, got = _ints(buf, i, lens, f)
                if i < 0 or i >= buf.size or buf[i] != _RBRACKET:
                    return fail
                f += got
                r += 1
                rows += 1
                i += 1
                if i >= buf.size:
                    return fail
                if buf[i] == _RBRACKET:
                    i += 1
                    break
                if buf[i] != _COMMA:
                    return fail
                i += 1
        row[NROWS] = rows
        if i >= buf.size or buf[i] != _RBRACE:
            return fail
        p += 1
        i += 1
        if i >= buf.size:
            return fail
        if buf[i] == _RBRACKET:
            if i + 1 != buf.size:
                return fail
            frame_at[r] = f
            return p, r, f, spans, distinct, counts, heads, frame_at, lens
        if buf[i] != _COMMA:
            return fail
        i += 1
