"""Session fixtures shared by the whole suite: tiny HF checkpoints, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.tiny_models import SPECS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Build (once per session) the tiny checkpoint of a family: `tiny_model_factory("llama")`."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in cache:
            cache[family] = make_tiny_model(family, root / family)
        return cache[family]

    return build


@pytest.fixture(scope="session", params=sorted(SPECS))
def tiny_model(request: pytest.FixtureRequest, tiny_model_factory) -> Path:
    """Each model family's tiny checkpoint, in turn."""
    return tiny_model_factory(request.param)
