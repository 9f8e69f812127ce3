"""Fixtures for the sender tests (helpers live in sender_helpers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.fx.experimental._config as fx_config
from sender_helpers import FakeEngine


@pytest.fixture
def fake_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16) for i in range(3)
    }


@pytest.fixture
def fake_engines(tmp_path, fake_weights):
    engines = [FakeEngine(tmp_path, fake_weights) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


@pytest.fixture
def meta_nonzero():
    """`nonzero` on meta has no true output size; assume every element (what tracing compilers do)."""
    old = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    yield
    fx_config.meta_nonzero_assume_all_nonzero = old
