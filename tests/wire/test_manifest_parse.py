"""`parse_manifest` (pydantic's own validation of the JSON text) gives what `Manifest.model_validate` of
the parsed JSON gives: the same manifest for what its schema takes, the same error for what it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_delta.wire import (
    DeltaWriter,
    FormatError,
    Manifest,
    merge_manifests,
    parse_manifest,
    write_manifest,
)


def _manifest(path: Path, tensors: int) -> bytes:
    """A delta's manifest as the writer writes it: `tensors` params with digests, one flush."""
    g = torch.Generator().manual_seed(tensors)
    with DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd") as w:
        for i in range(tensors):
            old = torch.randn(5, generator=g).to(torch.bfloat16)
            w.add(
                f"layer.{i}.w",
                torch.tensor([1, 5, 9, 20, 33]),
                (old.view(torch.int16) + 1).view(torch.bfloat16),
                old,
                shape=(8, 8),
            )
    return (path / "manifest.json").read_bytes()


def _with_digests(path: Path) -> bytes:
    """Every optional field given as a string (the sender's digests; a post_hash), but parts."""
    m = json.loads(_manifest(path, 7))
    for i, p in enumerate(m["params"]):
        p.update(
            post_hash=f"{i:032x}",
            digest=f"{i + 1:032x}",
            pre_digest=f"{i + 2:032x}",
            post_digest=f"{i + 3:032x}",
        )
    return json.dumps(m, indent=1).encode()


def _two_writers(path: Path) -> bytes:
    """One param with parts (two ranks' files), as merge_manifests writes it."""
    manifests = []
    for rank, positions in enumerate(([40, 41], [2, 3])):
        w = DeltaWriter(path, version=1, base_version=0, encoding="ulp_zstd", rank=rank)
        old = torch.zeros(2, dtype=torch.bfloat16)
        w.add("w", torch.tensor(positions), old + 1, old, shape=(64,))
        w.add(f"v{rank}", torch.tensor([1]), old[:1] + 1, old[:1], shape=(4,))
        manifests.append(w.manifest())
    write_manifest(path, merge_manifests(manifests))
    return (path / "manifest.json").read_bytes()


def _outcome(fn, text: bytes) -> tuple[str, str]:
    """The manifest made, or the error: its count and the fields at fault (the wording of a type error
    differs between pydantic's JSON and Python inputs: "a valid array" / "a valid list")."""
    try:
        m = fn(text)
    except (FormatError, ValueError) as e:
        return "error", "\n".join(line for line in str(e).splitlines() if not line.startswith(" "))
    return "manifest", repr(m) + m.model_dump_json() + repr([sorted(p.model_fields_set) for p in m.params])


def _model(text: bytes) -> Manifest:
    """The model's validation of the whole JSON, with parse_manifest's wording of its errors."""
    try:
        return Manifest.model_validate(json.loads(text))
    except ValueError as e:
        raise FormatError(f"invalid manifest: {e}", file="manifest.json") from None


@pytest.mark.parametrize(
    "make", [lambda p: _manifest(p, 7), _with_digests, _two_writers], ids=["plain", "digests", "parts"]
)
def test_parse_makes_the_models_manifest(tmp_path, make):
    text = make(tmp_path / "d")
    got, want = parse_manifest(text), _model(text)
    assert got == want and _outcome(parse_manifest, text) == _outcome(_model, text)


def _edit(i: int, **fields):
    return lambda ps: ps[i].update(fields)


def _pop(i: int, key: str):
    return lambda ps: ps[i].pop(key)


@pytest.mark.parametrize(
    "edit",
    [
        _edit(2, changed=0),
        _edit(2, changed=5.0),
        _edit(2, changed="5"),
        _edit(2, changed=True),
        _edit(1, shape=[-1, 8]),
        _edit(1, shape=[8.0, 8]),
        _edit(1, shape=["8", 8]),
        _edit(1, shape=(8, 8)),
        _edit(1, shape=[2**70, 1]),
        _edit(3, files=[]),
        _edit(3, files="f"),
        _edit(3, files=[1]),
        _edit(0, name=5),
        _edit(0, dtype=None),
        _edit(0, digest=5),
        _edit(0, post_hash=b"x".decode()),
        _edit(0, pre_digest=["a"]),
        _edit(4, extra=1),
        _pop(4, "parts"),
        _pop(4, "name"),
        _edit(5, parts=[["nope"]]),
        _edit(5, parts=[[]]),
        _edit(5, parts=["f"]),
        _edit(5, parts="x"),
        _edit(5, parts=[[1]]),
        lambda ps: ps[5].update(parts=[ps[5]["files"], 5]),
        _edit(5, parts=None),
        lambda ps: ps[5].update(parts=[ps[5]["files"], [1]]),
        lambda ps: ps.__setitem__(2, dict(reversed(list(ps[2].items())))),  # all fields, another order
        lambda ps: ps.__setitem__(2, "not an object"),
        lambda ps: ps.append(dict(ps[0])),  # listed twice
        lambda ps: ps[3].update(files=["unlisted"]),
        lambda ps: ps.clear(),
    ],
)
def test_whatever_the_schema_refuses_is_the_models_error(tmp_path, edit):
    """Each input gives what the model's validation of the same JSON gives: the manifest, or its error."""
    m = json.loads(_manifest(tmp_path / "d", 7))
    m["params"][5]["parts"] = [m["params"][5]["files"]]
    edit(m["params"])
    text = json.dumps(m).encode()
    assert _outcome(parse_manifest, text) == _outcome(_model, text)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(version="one"),
        lambda m: m.update(extra=1),
        lambda m: m["files"].append(m["files"][0]),
        lambda m: m.update(params="x"),
    ],
)
def test_a_fault_outside_the_params_is_the_models_error(tmp_path, edit):
    m = json.loads(_manifest(tmp_path / "d", 3))
    edit(m)
    text = json.dumps(m).encode()
    assert _outcome(parse_manifest, text)[0] == "error"
    assert _outcome(parse_manifest, text) == _outcome(_model, text)
