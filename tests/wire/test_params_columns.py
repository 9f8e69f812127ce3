"""A block-indexed flush's params read as columns from the JSON text (`flush_meta.heads_from_text`) are
what the JSON path makes of them, and anything that path alone should decide is left to it.

Why: the JSON parse of a flush's params and its walk were ~5 us a checkpoint tensor of prepare at
GLM-4.7's count (docs/results/scale.md, "Prepare per-tensor cost (session 10)"). The reference is
the JSON path itself (`flush_meta.parse_params` of the parsed JSON and `Rows.of` of its blocks): for
every input, the columns are None or equal to it, field for field. The JSON's own objects are
COUNTED, never timed: the columns path parses none a tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_delta.wire import FormatError, container, flush, flush_meta, iter_delta
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import Limits
from vllm_delta.wire.deltas import ParamChange
from vllm_delta.wire.encodings import get_encoding
from vllm_delta.wire.flush import open_flush
from vllm_delta.wire.flush_meta import Heads, Rows, heads_from_text, parse_params
from vllm_delta.wire.writer import encode_flush

GOLDEN = Path(__file__).parent / "golden"


def _changes(n: int = 4) -> list[ParamChange]:
    """Params of several shapes and dtypes; the first has several blocks (a small block policy)."""
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        dtype = (torch.bfloat16, torch.float32, torch.float16)[i % 3]
        shape = ((64, 32), (300,), (7, 3, 5))[i % 3]
        numel = int(torch.Size(shape).numel())
        pos = torch.randperm(numel, generator=g)[: 40 if i == 0 else 1 + i].sort().values
        old = torch.randn(pos.numel(), generator=g).to(dtype)
        new = (old.view({2: torch.int16, 4: torch.int32}[old.element_size()]) + 3).view(dtype)
        out.append(ParamChange(f"model.layers.{i}.w", shape, pos, new, old))
    return out


def _text(encoding: str = "ulp_zstd", n: int = 4) -> str:
    enc = get_encoding(encoding)
    data = encode_flush(
        _changes(n),
        encoding=enc,
        version=1,
        base_version=0 if enc.needs_base else None,
        policy=Policy(span_bits=0, min_entries=8, max_entries=8),
    ).data
    _, meta, _ = open_flush(data, file="f", limits=Limits())
    return meta["params"]


def _reference(text: str):
    """What the JSON path makes of `text`: its columns, or the path's decision (not columns)."""
    try:
        raw = container.json_loads(text)
    except ValueError:
        return "not JSON"
    try:
        heads = parse_params(raw, blocked=True, file="f")
    except FormatError:
        return "schema"
    rows = Rows.of(heads.blocks)
    return "per-param path" if rows is None else _fields(heads, rows)


def _fields(heads: Heads, rows: Rows) -> tuple:
    return (
        list(heads.name),
        list(heads.dtype),
        [tuple(s) for s in heads.shape],
        list(heads.count),
        list(heads.width),
        [tuple(s) for s in heads.streams],
        *(getattr(rows, f).tolist() for f in ("nrows", "head", "frames", "lens")),
    )


def _columns(text: str):
    got = heads_from_text(text)
    return None if got is None else _fields(got, got.rows)


@pytest.mark.parametrize("encoding", ["ulp_zstd", "planes_zstd", "deltas_zstd"])
def test_the_writers_params_are_read_as_the_json_path_reads_them(encoding):
    text = _text(encoding)
    want = _reference(text)
    assert isinstance(want, tuple) and max(want[6]) > 1  # a param of several blocks
    assert _columns(text) == want


def test_golden_flushes_are_read_as_the_json_path_reads_them():
    """Flushes written by earlier versions of the writer (tests/wire/golden, unchanged)."""
    seen = 0
    for path in sorted(GOLDEN.glob("v2*/*.safetensors")):
        _, meta, _ = open_flush(path.read_bytes(), file=path.name, limits=Limits())
        want = _reference(meta["params"])
        assert _columns(meta["params"]) == want, path
        seen += 1
    assert seen >= 5


def _edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, old
    return text.replace(old, new, count)


def _redump(text: str, key: str, value) -> str:
    """The second param's `key` set to `value`, written as the writer writes (compact JSON)."""
    raw = json.loads(text)
    raw[1][key] = value
    return json.dumps(raw, separators=(",", ":"))


EDITS = {  # each: an edit of the writer's text, and whether the columns must take it (else the JSON path)
    "as written": (lambda t: t, True),
    "18 digits": (lambda t: _edit(t, '"count":2,', '"count":100000000000000000,'), True),
    "minus zero width": (lambda t: _edit(t, '"width":1,', '"width":-0,'), True),
    "empty shape": (lambda t: _edit(t, '"shape":[300]', '"shape":[]'), True),
    "empty streams": (lambda t: _redump(t, "streams", []), True),
    "no blocks": (lambda t: _redump(t, "blocks", []), True),
    "a row's empty frames": (lambda t: _redump(t, "blocks", [[0, 0, 1, []]]), True),
    "DEL in a name": (lambda t: _edit(t, "model.layers.1", "model.layers\x7f1"), True),
    "space after a colon": (lambda t: _edit(t, '"count":', '"count": '), False),
    "trailing newline": (lambda t: t + "\n", False),
    "keys reordered": (lambda t: _edit(t, '"name":', '"nam":'), False),
    "escaped quote in a name": (lambda t: _edit(t, "model.layers.0", 'model.lay\\"ers.0'), False),
    "escaped letter in a name": (lambda t: _edit(t, "model.layers.0", "model.l\\u0061yers.0"), False),
    "non-ASCII name": (lambda t: _edit(t, "model.layers.0", "modèl.layers.0"), False),
    "tab in a name": (lambda t: _edit(t, "model.layers.0", "model.\tlayers.0"), False),
    "float count": (lambda t: _edit(t, '"count":2,', '"count":1.0,'), False),
    "exponent count": (lambda t: _edit(t, '"count":2,', '"count":1e0,'), False),
    "bool count": (lambda t: _edit(t, '"count":2,', '"count":true,'), False),
    "zero count": (lambda t: _edit(t, '"count":2,', '"count":0,'), False),
    "negative count": (lambda t: _edit(t, '"count":2,', '"count":-1,'), False),
    "negative width": (lambda t: _edit(t, '"width":1,', '"width":-1,'), False),
    "negative dim": (lambda t: _edit(t, '"shape":[300]', '"shape":[-300]'), False),
    "null shape": (lambda t: _edit(t, '"shape":[300]', '"shape":null'), False),
    "nested shape": (lambda t: _edit(t, '"shape":[300]', '"shape":[[300]]'), False),
    "int stream": (lambda t: _edit(t, '"streams":["pos0"', '"streams":[0'), False),
    "row of three": (lambda t: _edit(t, ",[", ",[[0,0,1],", 1), False),
    "float in a row": (lambda t: _edit(t, '"blocks":[[', '"blocks":[[0.5,'), False),
    "19 digits in a row": (lambda t: _edit(t, '"blocks":[[', '"blocks":[[1000000000000000000,'), False),
    "leading zero": (lambda t: _edit(t, '"count":2,', '"count":01,'), False),
    "trailing comma": (lambda t: t[:-1] + ",]", False),
    "bytes after the list": (lambda t: t + "x", False),
    "truncated": (lambda t: t[:-1], False),
    "empty list": (lambda t: "[]", False),
    "an object": (lambda t: '{"a":1}', False),
    "extra key": (lambda t: _edit(t, '"blocks":', '"z":1,"blocks":'), False),
    "missing key": (lambda t: _edit(t, '"width":1,', ""), False),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_edited_params_give_the_json_paths_columns_or_are_left_to_it(case):
    edit, taken = EDITS[case]
    text = edit(_text("ulp_zstd", 6))
    got = _columns(text)
    if taken:
        assert got is not None and got == _reference(text)
    else:
        assert got is None


def test_not_text_or_kernels_off_is_left_to_the_json_path(monkeypatch):
    text = _text()
    assert heads_from_text(text.encode()) is None and heads_from_text(None) is None
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert heads_from_text(text) is None


def _write(path: Path, n: int) -> Path:
    from vllm_delta.wire import DeltaWriter

    with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd") as w:
        for ch in _changes(n):
            w.add(ch.name, ch.positions, ch.new_values, ch.old_values, shape=ch.shape)
    return path


def _read(path: Path) -> list:
    out = []
    for d in iter_delta(path, current_version=0):
        out.append(
            (d.name, d.shape, d.dtype, d.positions.tolist(), d.values.tolist(), d.skipped, d.bounds, d.blocks)
        )
    return out


def test_a_delta_reads_the_same_with_the_kernels_off(tmp_path, monkeypatch):
    path = _write(tmp_path / "d", 12)
    on = _read(path)
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert _read(path) == on


@pytest.mark.parametrize("n", [6, 18])
def test_no_json_object_a_tensor_for_the_writers_params(tmp_path, monkeypatch, n):
    """COUNTED: the params text goes to the JSON parser only as its few distinct shape and stream lists,
    whatever the tensor count (the JSON path parsed it whole: objects a tensor)."""
    path = _write(tmp_path / f"d{n}", n)
    (flush_file,) = path.glob("*.safetensors")
    params = open_flush(flush_file.read_bytes(), file="f", limits=Limits())[1]["params"]
    parsed: list[str] = []
    real = container.json_loads

    def counting(text):
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(container, "json_loads", counting)
    monkeypatch.setattr(flush_meta, "json_loads", counting)
    list(iter_delta(path, current_version=0))
    # The container's header (bytes: the params text is one JSON string in it), the streams' metadata,
    # and the distinct shape and stream lists (3 shapes; a stream list per dtype and gap width).
    texts = [t for t in parsed if isinstance(t, str)]
    assert params not in texts and not any("model.layers" in t for t in texts)
    assert len(parsed) - len(texts) == 1 and len(texts) <= 1 + 3 + 6


def test_bad_params_still_give_the_json_paths_error():
    """A flush's params the columns leave to the JSON path raise what that path raises."""
    text = _edit(_text(), '"count":2,', '"count":0,')
    assert heads_from_text(text) is None
    with pytest.raises(FormatError, match="bad flush metadata") as got:
        meta = {"encoding": "ulp_zstd", "current_version": "1", "base_version": "0", "params": text}
        flush.iter_flush({}, {**meta, "format": flush.FORMAT_BLOCKS, "streams": "{}"}, 1 << 30, file="f")
    with pytest.raises(FormatError) as want:
        parse_params(json.loads(text), blocked=True, file="f")
    assert str(want.value) == str(got.value)


def _synthetic(shapes: int) -> str:
    """Params of `shapes` distinct shapes of one text length (the intern tables' probe chains), compact."""
    return json.dumps(
        [
            {
                "name": f"p{i}",
                "dtype": "bfloat16",
                "shape": [1000 + i % 9000, 7],
                "count": 1,
                "width": 1,
                "streams": ["pos0", "sign", "flag", "esc0", "esc1"],
                "blocks": [[i, i, 1, [9, 1] * 5]],
            }
            for i in range(shapes)
        ],
        separators=(",", ":"),
    )


def test_many_distinct_shapes_are_read_up_to_the_tables_bound():
    from vllm_delta.kernels import params_jit as _params_kernel

    text = _synthetic(_params_kernel.MAX_DISTINCT)
    assert _columns(text) == _reference(text)
    assert heads_from_text(_synthetic(_params_kernel.MAX_DISTINCT + 1)) is None  # left to the JSON path
