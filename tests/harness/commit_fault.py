"""A real commit fault, armed in an engine's processes by the test harness only.

Why outside the product: a test needs a commit that fails for real part-way (the scatter raises at a
live tensor after the tensors before it were written), on a real `vllm serve`. `engine_env` puts
`commit_fault_site/` on the engine's PYTHONPATH; its `sitecustomize` runs `install()` in every
process of that engine, which arms the fault when (and only if) the process imports the worker
extension, so nothing else is imported early. Armed, the worker's commit at `version` finds the
destination of `at` swapped for an empty tensor, so the scatter's offsets fall outside it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

WORKER = "vllm_delta.engine.worker"

FAULT_ENV = "VLLM_DELTA_TEST_FAULT_AT"  # "VERSION:TENSOR"
SITE = Path(__file__).with_name("commit_fault_site")


def engine_env(version: int, at: str) -> dict[str, str]:
    """The environment that arms the fault in an engine started with it."""
    tests = str(Path(__file__).parent.parent)
    path = os.pathsep.join(p for p in (str(SITE), tests, os.environ.get("PYTHONPATH")) if p)
    return {FAULT_ENV: f"{version}:{at}", "PYTHONPATH": path}


class _ArmOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the worker module's loading so `arm` runs right after it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != WORKER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_arm(module: Any) -> None:
            exec_module(module)
            arm(module.DeltaWorkerExtension)

        spec.loader.exec_module = exec_and_arm
        return spec


def install() -> None:
    sys.meta_path.insert(0, _ArmOnImport())


def arm(extension: Any) -> None:
    """Wrap `DeltaWorkerExtension.delta_commit` (both doors' workers inherit it) with the fault."""
    commit = extension.delta_commit
    at_version, _, name = os.environ[FAULT_ENV].partition(":")

    def delta_commit(self, request_id: str):
        state = self._delta()
        staged, targets = state.staged.get(request_id), state.applier.targets
        if staged is None or str(staged.version) != at_version or name not in targets:
            return commit(self, request_id)
        original = targets[name]
        targets[name] = original.new_empty(0)  # the scatter's offsets fall outside it: the scatter raises
        try:
            return commit(self, request_id)
        finally:
            targets[name] = original

    extension.delta_commit = delta_commit
