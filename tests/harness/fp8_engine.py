"""Block-fp8 engines for tests, on any CPU: the entry point that starts them.

Why: vLLM 0.32 serves block fp8 on CPU only with AMX tiles unless the engine's processes carry the
test-only stand-in of `harness.fp8_kernel` (its docstring says what it changes: the AMX gate, no
more). Every fp8 engine a test starts comes from here, so none is started without it; its workers
also answer `fp8_served` (`harness.fp8_inspect`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from harness.engine_pool import EnginePool
from harness.vllm_engine import VllmServer

SITE = Path(__file__).with_name("fp8_engine_site")


def engine_env() -> dict[str, str]:
    """An fp8 engine's environment: the site first on its PYTHONPATH, with tests/ (the site imports
    `harness`); its `sitecustomize` installs the stand-in and `fp8_served` in every process."""
    tests = str(Path(__file__).parent.parent)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(SITE), tests, os.environ.get("PYTHONPATH")) if p)}


def delta_server(
    pool: EnginePool, model_dir: Path, tp: int = 1, extra_args: Sequence[str] = ()
) -> VllmServer:
    """The pool's `vllm serve --enable-delta-updates` on `model_dir`, in dev mode (`/collective_rpc`)."""
    return pool.delta_engine(model_dir, tp, extra_args, env=engine_env())
