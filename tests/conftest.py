"""Session fixtures shared by the whole suite (tiny HF checkpoints, the engine pool, the fresh loader),
and the grouping that lets `make test` run on two pytest-xdist workers (`--dist loadgroup`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.tiny_models import SPECS, make_tiny_model

# Modules that take the session's shared Llama engine (harness/engine_pool.py): one worker runs them all.
SHARED_LLAMA = "shared_llama_engine"
SHARED_LLAMA_MODULES = {"test_server_bad_input", "test_prepare_while_serving", "test_stock_equivalence",
                        "test_sender_engine", "test_sharded_engine"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each heavy module on one xdist worker, so its module-scoped engine starts once; the
    shared-engine modules share one group. A module marked `spread` (one engine per test) is not
    grouped: its tests go to whichever worker is free."""
    for item in items:
        if item.get_closest_marker("heavy") is None or item.get_closest_marker("spread") is not None:
            continue
        module = item.module.__name__.rsplit(".", 1)[-1]
        item.add_marker(pytest.mark.xdist_group(SHARED_LLAMA if module in SHARED_LLAMA_MODULES else module))


@pytest.fixture(autouse=True)
def _delta_env_restored():
    """Parsing `--enable-delta-updates` writes its flag, root and plugin allowlist into os.environ, for
    the engine `vllm serve` starts next. In a test process that would leak into every engine a later
    test starts (a "stock" server would then run with delta updates on): give them back after each test."""
    from vllm_delta.engine.cli_args import ENV_FLAG
    from vllm_delta.native import ROOT_ENV

    saved = {name: os.environ.get(name) for name in (ENV_FLAG, ROOT_ENV, "VLLM_PLUGINS")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


@pytest.fixture(scope="session")
def fresh_loader():
    """`fresh_loader.checksums(model_dir)`: a fresh TP=1 load's `/weight_checker` digests, by vLLM's own
    loader in a child process (harness/fresh_load.py), started on first use and shared by the session."""
    from harness.fresh_load import FreshLoader

    loader = FreshLoader()
    yield loader
    loader.close()


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory: pytest.TempPathFactory):
    """Engines shared across modules, keyed by model and configuration (harness/engine_pool.py)."""
    from harness.engine_pool import EnginePool

    pool = EnginePool(tmp_path_factory.mktemp("engine_pool"))
    yield pool
    pool.close()
