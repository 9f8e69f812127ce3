"""The batched reader makes no torch op per checkpoint tensor: each param's positions and values are
views from one split per batch, not a slice each.

Why: a Python-level tensor slice costs ~2 us, and the reader made two per tensor (44k tensors on
GLM-4.7: docs/results/scale.md, "Prepare per-tensor cost (session 7, after the reader and staging
work)"). So the ops are COUNTED with a TorchDispatchMode (never timed): the same number for 40 and 120
tensors, with every param's delta still its own changes in its own dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.dispatch_log import OpLog

from vllm_delta.wire import DeltaWriter, FormatError, iter_delta, open_delta


def _dtype(i: int) -> torch.dtype:
    return torch.float32 if i % 7 == 0 else torch.bfloat16


def _delta(path: Path, tensors: int, encoding: str) -> dict[str, tuple[torch.Tensor, ...]]:
    """`tensors` small params of one shape and two dtypes, a few changes each (more in later ones), one
    flush."""
    g = torch.Generator().manual_seed(tensors)
    written = {}
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding) as w:
        for i in range(tensors):
            old = torch.randn(64, generator=g).to(_dtype(i))
            positions = torch.arange(1 + i % 5, 64, 7)
            new = old[positions].view(torch.int16 if _dtype(i) == torch.bfloat16 else torch.int32) + 1
            w.add(f"layer.{i}.w", positions, new.view(_dtype(i)), old[positions], shape=(8, 8))
            written[f"layer.{i}.w"] = (positions, old[positions], new.view(_dtype(i)))
    return written


def _read(path: Path, tensors: int, encoding: str) -> tuple[int, list]:
    info = open_delta(path)
    expected = {f"layer.{i}.w": ((8, 8), _dtype(i)) for i in range(tensors)}
    with OpLog() as log:
        deltas = list(
            iter_delta(
                info, expected=expected, current_version=0, owned={n: [(0, 63)] for n in expected}, lazy=True
            )
        )
    return [op.name for op in log.ops], deltas


@pytest.mark.parametrize("encoding", ["ulp_zstd", "deltas_zstd"])
def test_reader_torch_ops_do_not_grow_with_the_tensor_count(tmp_path, encoding):
    small, large = 40, 120
    ops = {}
    for n in (small, large):
        written = _delta(tmp_path / str(n), n, encoding)
        ops[n], deltas = _read(tmp_path / str(n), n, encoding)
        assert [d.name for d in deltas] == list(written)
        for d in deltas:  # each its own changes, in its own dtype (steps: signed integers of its width)
            positions, old, new = written[d.name]
            assert torch.equal(d.positions, positions) and d.dtype == new.dtype
            if d.needs_base:
                assert d.values.dtype == (torch.int16 if new.dtype == torch.bfloat16 else torch.int32)
            else:
                assert d.values.dtype == new.dtype
            assert torch.equal(d.resolve(old).view(torch.uint8), new.view(torch.uint8))
    assert ops[small] == ops[large], (len(ops[small]), len(ops[large]))
    assert "slice" not in ops[large] and "split_with_sizes" in ops[large]


def test_index_parse_makes_no_python_call_per_tensor(tmp_path):
    """wire/batch.py's index parse checks the rows as sets and lists (no generator resumed a row, no
    `DType.itemsize` property a param): the only call a tensor left in batch.py is decode's generator."""
    from test_reader_per_tensor import _counted
    from test_reader_per_tensor import _delta as _small_delta

    small, large = 40, 120
    _, a = _counted(_small_delta(tmp_path / "a", small))
    _, b = _counted(_small_delta(tmp_path / "b", large))
    grew = {k: (b[k] - a[k]) / (large - small) for k in set(a) | set(b) if k[0] in ("batch.py", "dtypes.py")}
    assert {k: g for k, g in grew.items() if g} == {("batch.py", "decode"): 1.0}


@pytest.mark.parametrize(
    "row",
    [lambda r: r + [0], lambda r: r[:3], lambda r: [*r[:3], 7], lambda r: 5],
    ids=["five", "three", "frames-not-a-list", "row-not-a-list"],
)
def test_a_malformed_block_row_is_refused_as_the_per_param_path_refuses_it(tmp_path, row):
    """The set checks of the rows' shape hand a malformed row to the per-param path (which names it),
    never read past or around it."""
    from test_reader_per_tensor import _delta as _small_delta
    from test_reader_per_tensor import _with_params

    path = _small_delta(tmp_path / "d", 12)

    def edit(params):
        params[5]["blocks"][0] = row(params[5]["blocks"][0])

    _with_params(path, edit)
    info = open_delta(path)
    expected = {f"layer.{i}.w": ((8, 8), torch.float32 if i % 7 == 0 else torch.bfloat16) for i in range(12)}
    with pytest.raises(FormatError, match="layer.5.w|block"):
        list(
            iter_delta(
                info, expected=expected, current_version=0, owned={n: [(0, 63)] for n in expected}, lazy=True
            )
        )
