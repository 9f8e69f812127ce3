"""Session fixtures shared by the whole suite: tiny HF checkpoints, the engine pool, the fresh loader.

Under `make test` (two pytest-xdist workers, `--dist loadscope`) each worker has its own session: a
module's tests, and a class's, stay on one worker, so a module-scoped engine starts once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness.tiny_models import SPECS, make_tiny_model

# The modules that serve from the pool's shared Llama (harness/engine_pool.py `shared_llama`). Under
# `make test` they are one xdist scope, so one worker starts that engine for all of them; as separate
# module scopes both workers started it (~35 s of a worker each). A module missing here still works:
# it starts the engine on its own worker.
SHARED_LLAMA_MODULES = frozenset(
    f"tests/{m}.py"
    for m in (
        "integrations/test_trl",
        "integrations/test_verl",
        "engine/test_prepare_while_serving",
        "engine/test_seed_push",
        "engine/test_server_bad_input",
        "engine/test_stock_equivalence",
        "reliability/test_soak",
        "sender/test_sender_engine",
        "sender/test_sharded_engine",
    )
)


# The modules that share the pool's fp8 engine (harness/fp8_engine.py `shared_server`): one xdist scope for
# the same reason. test_hook_fp8 comes last in collection order and stops the engine.
FP8_ENGINE_MODULES = frozenset({"tests/engine/test_fp8_served.py", "tests/megatron/test_hook_fp8.py"})
# The modules that serve from the session's engine pair (harness/engine_pair.py), one xdist scope for the
# same reason: one worker starts the pair (~50 s of a worker) for all of them.
ENGINE_PAIR_MODULES = frozenset(
    f"tests/{m}.py"
    for m in ("engine/test_security", "reliability/test_faults", "sender/test_collective_engine")
)
SHARED_SCOPES = {
    **dict.fromkeys(SHARED_LLAMA_MODULES, "shared-llama"),
    **dict.fromkeys(FP8_ENGINE_MODULES, "fp8-engine"),
    **dict.fromkeys(ENGINE_PAIR_MODULES, "engine-pair"),
}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with the shared-Llama modules as one scope, the fp8 engine's as another and the
    engine-pair modules as a third, and a node id's scope read before its parameters (loadscope cuts at
    the last "::", which a parameter id may contain)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = nodeid.split("[", 1)[0].rsplit("::", 1)[0]
            return SHARED_SCOPES.get(scope.split("::", 1)[0], scope)

    return Scopes(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Stop the engine pair once the worker's next test does not use it: a session fixture, it would
    hold two engines' memory to the session's end (the worker's other scopes start engines of their
    own). A later test that uses it starts it again."""
    yield
    pair = (getattr(item, "funcargs", None) or {}).get("engine_pair")
    if pair is not None and (nextitem is None or "engine_pair" not in getattr(nextitem, "fixturenames", ())):
        pair.stop()


@pytest.fixture(autouse=True)
def _delta_env_restored():
    """Parsing `--enable-delta-updates` writes its flag, root, keys and plugin allowlist into os.environ, for
    the engine `vllm serve` starts next. In a test process that would leak into every engine a later
    test starts (a "stock" server would then run with delta updates on): give them back after each test."""
    from vllm_delta.engine.cli_args import ENV_FLAG
    from vllm_delta.settings import SIGNING_KEY_FILE, SIGNING_KEYS
    from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV

    names = (ENV_FLAG, ROOT_ENV, "VLLM_PLUGINS", SIGNING_KEYS, SIGNING_KEY_FILE)
    saved = {name: os.environ.get(name) for name in names}
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


@pytest.fixture(scope="session")
def engine_pair(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory):
    """Two tiny-Llama delta engines shared by the engine-pair modules (harness/engine_pair.py)."""
    from harness.engine_pair import EnginePair

    pair = EnginePair(tiny_model_factory("llama"), tmp_path_factory.mktemp("engine_pair"))
    yield pair
    pair.close()
