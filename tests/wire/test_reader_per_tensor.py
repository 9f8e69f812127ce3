"""The reader's work per checkpoint tensor stays fixed and small; its fast paths keep every check.

Why: at a production tensor count (44k tensors) every Python call the reader makes per tensor
costs prepare a measurable share (docs/results/scale.md, "Reader per-tensor cost (session 7)").
So the calls are COUNTED (never timed): schema validations per flush and head lookups do not grow
with the tensor count, and the Python calls per tensor are bounded. The fast paths behind those
counts (slotted schemas, cached heads, one-dict ParamDelta) are held to the checks and the error
messages of the code they replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from vllm_delta.wire import (
    BoundsError,
    DeltaError,
    DeltaWriter,
    FormatError,
    ParamDelta,
    ShapeMismatchError,
    iter_delta,
    merge_manifests,
    open_delta,
    parse_manifest,
    read_delta,
    write_manifest,
)
from vllm_delta.wire import flush as flush_mod
from vllm_delta.wire.container import json_loads, pack, unpack
from vllm_delta.wire.deltas import DeltaBatch
from vllm_delta.wire.flush_meta import HeadCheck, parse_params

MINE = {"reader.py", "flush.py", "flush_meta.py", "deltas.py", "manifest.py", "container.py"}  # the reader's
# Python calls a tensor, as measured when this was written (26 in the whole package before session 7, 8
# after it): in the modules above the ParamDelta (make, __init__, total) and the admit and iter_delta
# generators resumed; in the whole package also wire/batch.py's decode generator (session 8: the heads
# are checked as columns, no call a param).
MINE_PER_TENSOR = 5
WIRE_PER_TENSOR = 6
BATCHED_PER_TENSOR = 0  # read in decoded batches, as prepare reads (measured: 0)
# Lines run in the package a tensor, the same way (session 9; measured 2, was 17): the two left are
# ParamEntry's own model validator, which pydantic runs on every entry however it was made.
BATCHED_LINES_PER_TENSOR = 2


def _dtype(i: int) -> torch.dtype:
    return torch.float32 if i % 7 == 0 else torch.bfloat16


def _delta(path: Path, tensors: int) -> Path:
    """`tensors` small params of one shape and two dtypes, a few changes each, in one flush."""
    g = torch.Generator().manual_seed(tensors)
    with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd") as w:
        for i in range(tensors):
            old = torch.randn(5, generator=g).to(_dtype(i))
            new = (old.view(torch.int16 if _dtype(i) == torch.bfloat16 else torch.int32) + 1).view(_dtype(i))
            w.add(f"layer.{i}.w", torch.tensor([1, 5, 9, 20, 33]), new, old, shape=(8, 8))
    return path


def _counted(path: Path, batches: bool = False) -> tuple[int, collections.Counter]:
    """Decode as prepare does (lazily, expected shapes, owned ranges; with `batches`, in decoded batches),
    counting Python calls into the package by (module, function) and the C-level schema validations
    (pydantic's SchemaValidator); the tensors read."""
    info = open_delta(path)
    expected = {p.name: ((8, 8), _dtype(int(p.name.split(".")[1]))) for p in info.manifest.params}
    owned = {name: [(0, 63)] for name in expected}
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and "vllm_delta" in frame.f_code.co_filename:
            calls[(Path(frame.f_code.co_filename).name, frame.f_code.co_name)] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") in (
            "validate_python",
            "validate_json",
            "validate_strings",
        ):
            calls[("pydantic", "validate")] += 1

    sys.setprofile(profile)
    try:
        n = sum(
            len(d) if isinstance(d, DeltaBatch) else 1
            for d in iter_delta(
                info, expected=expected, current_version=0, owned=owned, lazy=True, batches=batches
            )
        )
    finally:
        sys.setprofile(None)
    return n, calls


def _params_parsed(calls: collections.Counter) -> int:
    """Flushes' `params` parsed (from the text as written, or from the JSON)."""
    return calls[("flush_meta.py", "heads_from_text")] + calls[("flush_meta.py", "parse_params")]


def test_reader_calls_per_tensor_are_bounded_and_validations_are_per_flush(tmp_path):
    small, large = 40, 120
    n_small, a = _counted(_delta(tmp_path / "a", small))
    n_large, b = _counted(_delta(tmp_path / "b", large))
    assert (n_small, n_large) == (small, large)
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b)}
    # Once per flush (and per manifest), whatever the tensor count: no per-tensor model validation.
    assert a[("pydantic", "validate")] == b[("pydantic", "validate")]
    assert _params_parsed(a) == _params_parsed(b) > 0
    # Heads are looked up once per distinct dtype / shape, and checked against the model in one comparison.
    for fn in ("by_name", "check_expected", "check_numel", "parse_index"):
        assert grew.get(next((k for k in grew if k[1] == fn), None), 0) == 0, fn
    mine = sum(g for (module, _), g in grew.items() if module in MINE)
    assert mine <= MINE_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g and k[0] in MINE)
    assert sum(grew.values()) <= WIRE_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g)


def test_reading_in_batches_makes_no_call_a_tensor(tmp_path):
    """What prepare reads (`batches=True`): a run of params decoded together is one object, checked as
    columns, so no Python call into the package grows with the tensors."""
    small, large = 40, 120
    n_small, a = _counted(_delta(tmp_path / "a", small), batches=True)
    n_large, b = _counted(_delta(tmp_path / "b", large), batches=True)
    assert (n_small, n_large) == (small, large)
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b)}
    assert a[("pydantic", "validate")] == b[("pydantic", "validate")]
    assert _params_parsed(a) == _params_parsed(b) > 0
    assert sum(grew.values()) <= BATCHED_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g)


def _lines(path: Path) -> tuple[int, collections.Counter]:
    """Open and read as prepare does (manifest, then decoded batches), counting the lines run in the
    package by (module, function, line): a Python loop's body counts once a pass."""
    lines: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        if "vllm_delta" not in frame.f_code.co_filename:
            return None
        if event == "line":
            lines[(Path(frame.f_code.co_filename).name, frame.f_code.co_name, frame.f_lineno)] += 1
        return trace

    sys.settrace(trace)
    try:
        info = open_delta(path)
        expected = {p.name: ((8, 8), _dtype(int(p.name.split(".")[1]))) for p in info.manifest.params}
        owned = {name: [(0, 63)] for name in expected}
        n = sum(
            len(d)
            for d in iter_delta(
                info, expected=expected, current_version=0, owned=owned, lazy=True, batches=True
            )
        )
    finally:
        sys.settrace(None)
    return n, lines


def test_opening_and_reading_in_batches_runs_no_line_a_tensor(tmp_path):
    """No Python loop a tensor either, from the manifest's JSON to the decoded batches (session 9: the
    manifest's params, the decoder's tables, the owned ranges and the heads as columns)."""
    small, large = 40, 120
    n_small, a = _lines(_delta(tmp_path / "a", small))
    n_large, b = _lines(_delta(tmp_path / "b", large))
    assert (n_small, n_large) == (small, large)
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b)}
    assert sum(grew.values()) <= BATCHED_LINES_PER_TENSOR, sorted((k, g) for k, g in grew.items() if g)


def test_param_delta_sets_every_field_and_stays_frozen():
    x = torch.arange(3)
    args = dict(
        name="w",
        shape=(3,),
        dtype=torch.bfloat16,
        positions=x,
        values=x,
        needs_base=True,
        skipped=2,
        bounds=(0, 9),
        blocks=(1, 2),
    )
    assert [f.name for f in dataclasses.fields(ParamDelta)] == list(args)
    for d in (ParamDelta(**args), ParamDelta(*args.values())):
        assert {f: getattr(d, f) for f in args} == args
        with pytest.raises(dataclasses.FrozenInstanceError):
            d.skipped = 0
    default = ParamDelta("w", (3,), torch.bfloat16, x, x, False)
    assert (default.skipped, default.bounds, default.blocks) == (0, None, (0, 0))
    assert dataclasses.replace(default, skipped=1).skipped == 1


def _with_params(path: Path, edit) -> list:
    """Edit the `params` metadata of the delta's flush (re-signing the file's hash in the manifest); the
    edited params."""
    info = open_delta(path)
    name = info.manifest.files[0].name
    tensors, meta = unpack((path / name).read_bytes(), file=name, limits=flush_mod.Limits())
    params = json.loads(meta["params"])
    edit(params)
    data = pack({k: bytes(t.data) for k, t in tensors.items()}, {**meta, "params": json.dumps(params)})
    (path / name).write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), hash=flush_mod.bytes_digest(data))
    (path / "manifest.json").write_text(json.dumps(m))
    return params


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda ps: ps[1].update(extra=1), r"params\[1\] has unknown fields \['extra'\]"),
        (lambda ps: ps.__setitem__(1, "not an object"), r"params\[1\] is not an object"),
        (lambda ps: ps[1].update(count=0), r"params\[1\].count is not an int >= 1"),
        (lambda ps: ps[1].pop("width"), r"params\[1\] lacks fields \['width'\]"),
        (lambda ps: ps[1].update(dtype={"a": 1}), r"params\[1\].dtype is not a string"),
        (lambda ps: ps[1].update(shape=8), r"params\[1\].shape is not a list of ints >= 0"),
        (lambda ps: ps[1].update(count=True), r"params\[1\].count is not an int >= 1"),
    ],
)
def test_bad_flush_metadata_says_which_param_and_field(tmp_path, edit, says):
    _with_params(d := _delta(tmp_path / "d", 3), edit)
    with pytest.raises(FormatError, match="bad flush metadata: " + says):
        read_delta(d, current_version=0)


def test_deeply_nested_flush_metadata_is_a_format_error(tmp_path):
    _with_params(d := _delta(tmp_path / "d", 3), lambda ps: ps[1].update(blocks=[[[[[]]]]]))
    name = open_delta(d).manifest.files[0].name
    tensors, meta = unpack((d / name).read_bytes(), file=name, limits=flush_mod.Limits())
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(FormatError, match="not JSON"):
        flush_mod.iter_flush(tensors, {**meta, "params": deep}, 1 << 30, file=name)


def test_cached_heads_still_check_each_param_against_the_model(tmp_path):
    """Params 1 and 2 share a head; the model disagrees only on param 2's shape."""
    d = _delta(tmp_path / "d", 3)
    expected = {f"layer.{i}.w": ((8, 8), _dtype(i)) for i in range(3)}
    assert sum(x.count for x in read_delta(d, expected=expected, current_version=0)) == 15
    # A list shape (not a tuple) takes the precise check, and passes.
    assert (
        len(read_delta(d, expected={**expected, "layer.2.w": ([8, 8], torch.bfloat16)}, current_version=0))
        == 3
    )
    heads = HeadCheck({**expected, "layer.2.w": ((4, 16), torch.bfloat16)}, file="f")
    info = open_delta(d)
    tensors, meta = unpack(
        (d / info.manifest.files[0].name).read_bytes(), file="f", limits=flush_mod.Limits()
    )
    params = parse_params(json.loads(meta["params"]), blocked=True, file="f").entries()
    heads(*params[1][:4])
    with pytest.raises(ShapeMismatchError, match=r"shape \[8, 8\] != model's \[4, 16\]"):
        heads(*params[2][:4])
    with pytest.raises(FormatError, match="65 changes in 64 elements"):
        heads(*params[1]._replace(count=65)[:4])


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, 2.5, -0, 1e400, "\\u00e9"], "a": null}',
        "123456789012345678901234567890",
        "NaN",
        "[-Infinity]",
        '"\\ud800"',
        "[" * 300 + "]" * 300,  # accepted by json.loads, not by pydantic-core's parser
        "[1,]",
        '{"a":1,}',
        "01",
        "[1] x",
        '"a\tb"',
        "",
        "nan",
        "\ufeff[1]",  # refused by both
    ],
)
def test_json_loads_is_json_loads(text):
    """The same value or the same error as the standard library's, for each of str and bytes."""
    for given in (text, text.encode("utf-8", "surrogatepass")):
        try:
            want = repr(json.loads(given))
        except ValueError as e:
            with pytest.raises(type(e), match=re.escape(str(e))):
                json_loads(given)
        else:
            assert repr(json_loads(given)) == want


@pytest.mark.parametrize(
    "params, says",
    [
        ([("a", ["f"]), ("b", ["f"]), ("a", ["f"])], "param 'a' listed twice"),
        ([("a", ["f"]), ("b", ["f", "g"])], r"param 'b' names unlisted files \['g'\]"),
        (
            [("a", ["f"]), ("b", ["g"]), ("b", ["f"])],
            r"param 'b' names unlisted files \['g'\]",
        ),  # the first at fault
        ([("a", ["f"]), ("a", ["f"]), ("b", ["g"])], "param 'a' listed twice"),
    ],
)
def test_manifest_names_the_first_param_at_fault(params, says):
    entries = [{"name": n, "dtype": "bfloat16", "shape": [4], "changed": 1, "files": fs} for n, fs in params]
    text = json.dumps(
        {
            "version": 1,
            "encoding": "ulp_zstd",
            "files": [{"name": "f", "bytes": 1, "hash": "h"}],
            "params": entries,
        }
    )
    with pytest.raises(FormatError, match=says):
        parse_manifest(text.encode())


def _two_writers(path: Path, first: list[int], second: list[int]) -> Path:
    """One param written by two ranks (each its own file, a part of its own), rank 0's file first."""
    manifests = []
    for rank, positions in enumerate((first, second)):
        w = DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd", rank=rank)
        old = torch.zeros(len(positions), dtype=torch.bfloat16)
        w.add("w", torch.tensor(positions), old + 1, old, shape=(64,))
        manifests.append(w.manifest())
    write_manifest(path, merge_manifests(manifests))
    return path


def test_each_writers_part_is_in_order_on_its_own(tmp_path):
    """Rank 1 holds lower positions than rank 0: fine across parts, never within one."""
    deltas = read_delta(_two_writers(tmp_path / "d", [40, 41, 50], [2, 3]), current_version=0)
    assert [d.positions.tolist() for d in deltas] == [[40, 41, 50], [2, 3]]
    with pytest.raises(BoundsError, match="parts from different writers overlap"):
        read_delta(_two_writers(tmp_path / "o", [40, 41], [3, 41]), current_version=0)


def test_a_param_in_a_file_the_manifest_does_not_list_it_for(tmp_path):
    d = _two_writers(tmp_path / "d", [40], [2])
    m = json.loads((d / "manifest.json").read_text())
    m["params"][0].update(files=[m["files"][0]["name"]], parts=None, changed=1)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="param is not listed for this file in the manifest") as e:
        read_delta(d, current_version=0)
    assert e.value.file == m["files"][1]["name"]


def _set(i: int, **fields):
    return lambda params: params[i].update(fields)


@pytest.mark.parametrize(
    "edit",
    [
        _set(3, shape=[4, 16]),  # the flush's shape differs from the manifest's
        _set(5, dtype="float32"),  # ... its dtype
        _set(2, changed=4),  # more changes than the manifest lists
        lambda params: params.pop(4),  # a param the manifest does not list
    ],
    ids=["shape", "dtype", "count", "unlisted"],
)
def test_a_batch_is_refused_as_its_params_are(tmp_path, edit):
    """The cross-file checks of a decoded batch (taken as columns) refuse what the per-param checks
    refuse, with the same error, file and param."""
    d = _delta(tmp_path / "d", 6)
    m = json.loads((d / "manifest.json").read_text())
    edit(m["params"])
    (d / "manifest.json").write_text(json.dumps(m))
    errors = []
    for batches in (False, True):
        with pytest.raises(DeltaError) as e:
            list(iter_delta(open_delta(d), current_version=0, lazy=True, batches=batches))
        errors.append((type(e.value), str(e.value), e.value.file, e.value.param))
    assert errors[0] == errors[1]


def test_batches_carry_the_same_changes_as_params(tmp_path):
    """`DeltaBatch.deltas()` and the per-param reader give the same changes, field for field."""
    d = _delta(tmp_path / "d", 9)
    one = read_delta(d, current_version=0)
    items = read_delta(d, current_version=0, batches=True)
    assert {type(i) for i in items} == {DeltaBatch}
    whole = [pd for item in items for pd in item.deltas()]
    assert len(whole) == len(one) == 9
    for a, b in zip(one, whole):
        assert (a.name, a.shape, a.dtype, a.needs_base, a.skipped, a.bounds, a.blocks) == (
            b.name,
            b.shape,
            b.dtype,
            b.needs_base,
            b.skipped,
            b.bounds,
            b.blocks,
        )
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
    assert sum(i.total for i in items) == sum(pd.total for pd in one)
