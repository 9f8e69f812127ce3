"""`local_checkpoint_dir`: a local model directory as is, an HF hub id from the local HF cache only.

Offline, vLLM itself rewrites a hub id to its snapshot directory (the engine test serves a hub id
that way); online it keeps the id, and the backend must then find the snapshot vLLM downloaded
without fetching anything. Both are checked here on a real cache layout, with no network.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from native_helpers import HUB_ID, hub_cache

from vllm_delta.engine.worker import local_checkpoint_dir


def config(model: str, download_dir: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None),
        load_config=SimpleNamespace(download_dir=download_dir),
    )


def test_local_dir_and_hub_id(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    snapshot = hub_cache(model, tmp_path / "hf")
    assert local_checkpoint_dir(config(str(model))) == str(model)
    assert local_checkpoint_dir(config(HUB_ID, str(tmp_path / "hf" / "hub"))) == str(snapshot)


def test_hub_id_not_in_cache_is_never_fetched(tmp_path):
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises(LocalEntryNotFoundError):
        local_checkpoint_dir(config("nobody/not-cached", str(tmp_path / "empty")))
