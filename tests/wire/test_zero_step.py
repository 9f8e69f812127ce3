"""`ulp_zstd` cannot carry a step of 0: the writer refuses an unchanged position, naming the param.

Why: the step codec flags only `|step| > 1`, so a 0 step decodes as +1 ULP and the receiver would
move a value that did not change. Unchanged means bitwise equal, so a NaN listed with its own bits
is refused too, while -0.0 -> +0.0 is a real change.
"""

from __future__ import annotations

import pytest
import torch

from vllm_delta.wire import DeltaWriter, read_delta, writer

NAME = "model.layers.0.mlp.down_proj.weight"


def values() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pos = torch.tensor([1, 4, 9, 12], dtype=torch.int64)
    old = torch.tensor([0.5, float("nan"), -0.0, 2.0], dtype=torch.bfloat16)
    new = torch.tensor([0.75, float("nan"), 0.0, 2.0], dtype=torch.bfloat16)  # positions 4 and 12 unchanged
    return pos, new, old


def test_ulp_zstd_refuses_unchanged_positions(tmp_path):
    pos, new, old = values()
    with pytest.raises(ValueError, match=NAME) as exc:
        with DeltaWriter(tmp_path / "d", version=1, base_version=0, encoding="ulp_zstd") as w:
            w.add(NAME, pos, new, old, shape=(4, 4))
    assert isinstance(exc.value, writer.UnchangedValueError)
    assert exc.value.param == NAME and exc.value.positions == [4, 12] and exc.value.encoding == "ulp_zstd"
    assert not (tmp_path / "d" / "manifest.json").exists()  # nothing was sealed


def test_changed_positions_round_trip_and_overwrite_encodings_accept_unchanged_ones(tmp_path):
    pos, new, old = values()
    keep = torch.tensor([True, False, True, False])
    with DeltaWriter(tmp_path / "ulp", version=1, base_version=0, encoding="ulp_zstd") as w:
        w.add(NAME, pos[keep], new[keep], old[keep], shape=(4, 4))
    with DeltaWriter(tmp_path / "planes", version=1, encoding="planes_zstd") as w:
        w.add(NAME, pos, new, old, shape=(4, 4))  # an overwrite rewrites the same bits: harmless
    for d, current in ((tmp_path / "ulp", 0), (tmp_path / "planes", None)):
        target = torch.zeros(16, dtype=torch.bfloat16)
        target[pos] = old
        for pd in read_delta(d, current_version=current):
            pd.apply_(target.view(4, 4))
        assert torch.equal(target[pos].view(torch.int16), new.view(torch.int16)), d.name
