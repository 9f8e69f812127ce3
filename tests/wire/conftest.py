"""Fixtures for the wire tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from wire_helpers import model_tensors, perturb, write_checkpoint


@pytest.fixture(params=["sharded", "single"])
def checkpoints(request, tmp_path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(OLD dir, NEW dir, NEW tensors) in HF layout; NEW has ~5% of elements moved by one ULP."""
    old = model_tensors(0)
    new = perturb(old, 1)
    sharded = request.param == "sharded"
    return (
        write_checkpoint(tmp_path / "old", old, sharded=sharded),
        write_checkpoint(tmp_path / "new", new, sharded=sharded),
        new,
    )
