"""Runs first in every process of an engine the harness starts (`harness.vllm_engine` puts this
directory first on the engine's PYTHONPATH): the cyclic garbage collector runs rarely while the process
imports vLLM, and with the interpreter's defaults from vLLM's first explicit collection on; then the
next `sitecustomize` on the path runs (a test's own site: commit_fault_site, fp8_engine_site, torch_moe).

Why: most of a tiny engine's start is its three processes (API server, engine core, worker) importing
vLLM and torch, about 7.5 s of CPU each on this machine; the collector's passes over the growing heap
are about a tenth of that. vLLM collects explicitly once its own startup is over (the worker after
loading the weights, the API server and the engine core when they freeze the heap), so what serves,
syncs and is checked runs with the defaults. No code of vLLM's or ours is patched; `gc.collect` is
wrapped only to notice that first call, and is itself again from then on.
"""

import gc
import importlib.machinery
import importlib.util
import os
import sys

STARTUP_THRESHOLD = (100_000, 50, 100)  # the default is (700, 10, 10)
_DEFAULT_THRESHOLD = gc.get_threshold()
_collect = gc.collect


def _collect_with_defaults(*args, **kwargs):
    gc.collect = _collect
    gc.set_threshold(*_DEFAULT_THRESHOLD)
    return _collect(*args, **kwargs)


def _run_next_site() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


gc.set_threshold(*STARTUP_THRESHOLD)
gc.collect = _collect_with_defaults
_run_next_site()
