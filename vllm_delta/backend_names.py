"""Our names in vLLM's weight-transfer registries and who holds them (vLLM keeps the first registrant, and
SkyRL registers `delta` too): `vllm_delta` is ours alone, `delta` while nobody else holds it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import packages_distributions

BACKEND = "vllm_delta"  # ours alone
ALIAS = "delta"  # ours too while no other package registered it first
OUR_MODULES = "vllm_delta."


def holder(registry: Mapping[str, Callable[[], type]], name: str) -> str | None:
    """The module of the class registered as `name`, read from vLLM's loader without importing it."""
    loader = registry.get(name)
    if loader is None:
        return None
    found = inspect.getclosurevars(loader).nonlocals
    if "module_path" in found:  # register_engine(name, "module.path", "Class")
        return str(found["module_path"])
    cls = found.get("engine_cls")  # register_engine(name, Class)
    return getattr(cls, "__module__", None) or repr(loader)


def package_of(module: str) -> str:
    """The installed distribution(s) a module comes from, for an error that names who to uninstall."""
    top = module.split(".")[0]
    dists = sorted(set(packages_distributions().get(top, [])))
    return f"{', '.join(dists)} (module {module})" if dists else f"module {module} (no installed package)"


def is_ours(name: str | None) -> bool:
    """Whether vLLM's engine registry resolves `name` to our backend, once every vLLM plugin loaded."""
    if name not in (BACKEND, ALIAS):
        return False
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # once per process: the registry is final after it
    module = holder(WeightTransferEngineFactory._registry, name)
    return module is not None and module.startswith(OUR_MODULES)
