"""Two packages in vLLM's weight-transfer registries: a second plugin that registers `delta` first (as
SkyRL does) keeps it, and one that holds `vllm_delta` is refused at startup, by its package's name.

The rival is a real installed package (a dist-info with its `vllm.general_plugins` entry point, in a
directory put on sys.path), loaded through importlib's entry points into vLLM's real registries.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from importlib.metadata import entry_points

import pytest

from vllm_delta.backend_names import ALIAS, BACKEND, holder, is_ours
from vllm_delta.engine.cli_args import check_args
from vllm_delta.weight_transfer.registry import TRAINER, WORKER, BackendNameTaken, register_backends

RIVAL = """
import os

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory


def register():
    names = ["delta"] + (["vllm_delta"] if os.environ.get("RIVAL_TAKES_OURS") else [])
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        for name in names:
            if name not in factory._registry:
                factory.register_engine(name, "rival_rl.backend", "RivalEngine")
"""


@pytest.fixture
def registries(tmp_path, monkeypatch):
    """vLLM's two registries with every installed plugin loaded but our names removed, then the rival
    installed (not loaded); restored afterwards."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    (tmp_path / "rival_rl").mkdir()
    (tmp_path / "rival_rl" / "__init__.py").write_text(RIVAL)
    info = tmp_path / "rival_rl-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rival-rl\nVersion: 0.3.0\n")
    (info / "top_level.txt").write_text("rival_rl\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nrival = rival_rl:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    factories = (WeightTransferEngineFactory, WeightTransferTrainerFactory)
    saved = [dict(f._registry) for f in factories]
    for f in factories:
        for name in (BACKEND, ALIAS):
            f._registry.pop(name, None)
    yield factories
    for f, registry in zip(factories, saved):
        f._registry.clear()
        f._registry.update(registry)
    sys.modules.pop("rival_rl", None)


def load_rival() -> None:
    (plugin,) = entry_points(group="vllm.general_plugins", name="rival")
    plugin.load()()


def test_a_rival_holding_delta_keeps_it_and_we_answer_to_our_own_name(registries):
    load_rival()
    register_backends()
    for factory, (module, _) in zip(registries, (WORKER, TRAINER)):
        assert holder(factory._registry, ALIAS) == "rival_rl.backend"
        assert holder(factory._registry, BACKEND) == module
    assert is_ours(BACKEND) and not is_ours(ALIAS)


def test_delta_is_ours_while_free(registries):
    register_backends()
    register_backends()  # idempotent: plugins load more than once per process
    assert is_ours(BACKEND) and is_ours(ALIAS)


def test_a_rival_holding_our_name_is_refused_naming_its_package(registries, monkeypatch):
    monkeypatch.setenv("RIVAL_TAKES_OURS", "1")
    load_rival()
    with pytest.raises(
        BackendNameTaken, match=r"'vllm_delta' is already registered by rival-rl \(module rival_rl"
    ):
        register_backends()
    assert not is_ours(BACKEND)


def test_the_cli_checks_only_what_is_ours(registries):
    """`delta` held by the rival is none of our business at parse time; `vllm_delta` is."""
    load_rival()
    register_backends()
    args = lambda name: Namespace(weight_transfer_config={"backend": name}, data_parallel_size=2)  # noqa: E731
    check_args(args(ALIAS))
    with pytest.raises(ValueError, match="--data-parallel-size 2"):
        check_args(args(BACKEND))
