"""A block-indexed flush's `params` metadata as columns read straight from its JSON text, where the
writer wrote it: what `batch.Heads.of` makes of the parsed JSON, with the block rows as arrays.

Why: parsed as JSON, a flush's params are ~17 Python objects a checkpoint tensor (a dict, 5 lists,
8 strings, ints), which `Heads.of` and `batch.Rows.of` then walk in ~20 C-level passes: ~5 us a
tensor at GLM-4.7's count (44k tensors a flush), the largest part of prepare's fixed cost. Here one
compiled scan (wire/_params_kernel.py) reads the bytes `flush.encode_flush` writes (compact JSON,
ASCII, no escape, the keys in its order) into arrays; a tensor then costs its name, three short
strings looked up in small tables and no list.

Anything else (other spacing or key order, escapes, floats, ints past 18 digits, a value of another
type, or one that `Heads.of` would not take) gives None, and the caller parses the JSON as before,
so the same input gives the same columns or the same decision and error. With the receiver's
compiled kernels off (`kernels.switch.on`) it always gives None.
"""

from __future__ import annotations

import numpy as np

from vllm_delta.kernels import switch

from .batch import Heads, Rows
from .container import json_loads

_KEYS = tuple(np.frombuffer(k.encode(), dtype=np.uint8) for k in (
    '{"name":', ',"dtype":', ',"shape":', ',"count":', ',"width":', ',"streams":', ',"blocks":'))


def heads(text: object) -> Heads | None:
    """The columns of a flush's `params` JSON text, or None (the caller parses the JSON)."""
    if type(text) is not str or not switch.on():
        return None
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        return None
    from . import _params_kernel as k  # numba on first use

    n, nrows, nframes, spans, distinct, counts, head, frame_at, lens = k.scan(
        np.frombuffer(raw, dtype=np.uint8), _KEYS)
    if n < 1:
        return None
    texts = [[text[a:b] for a, b in distinct[field, :counts[field]].tolist()] for field in range(3)]
    dtypes, shapes, streams = texts[0], _lists(texts[1]), _lists(texts[2])
    if shapes is None or streams is None:
        return None
    count, width = (tuple(spans[:n, c].tolist()) for c in (k.COUNT, k.WIDTH))
    # Heads.of's bounds (its types hold by the scan: ints, strings, lists of them).
    if min(count) < 1 or min(width) < 0 or min(map(min, filter(None, shapes)), default=0) < 0:
        return None
    rows = Rows(spans[:n, k.NROWS].copy(), head[:nrows].copy(), np.diff(frame_at[:nrows + 1]), lens[:nframes].copy())
    names = tuple(map(text.__getitem__, map(slice, spans[:n, k.NAME_A].tolist(), spans[:n, k.NAME_B].tolist())))
    return Heads(names, *(tuple(map(table.__getitem__, spans[:n, c].tolist()))
                          for table, c in ((dtypes, k.DTYPE), (shapes, k.SHAPE))),
                 count, width, tuple(map(streams.__getitem__, spans[:n, k.STREAMS].tolist())), (), rows)


def _lists(texts: list[str]) -> list[tuple] | None:
    """Each distinct text's JSON list (ints, or strings) as a tuple: one object for all its params."""
    values = list(map(json_loads, texts))
    return list(map(tuple, values)) if all(type(v) is list for v in values) else None
