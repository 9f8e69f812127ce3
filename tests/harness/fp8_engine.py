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


def shared_server(pool: EnginePool) -> VllmServer:
    """The fp8 engine the fp8 modules share (one start instead of one a module; tests/conftest.py puts them
    in one xdist scope): started on the tiny fp8 Llama of `harness.fp8_models`. What it holds when a module
    gets it is whatever ran before, so each module first puts its own weights on it with vLLM's
    `reload_weights` (same geometry, `fp8_models.HEADS`)."""
    from harness.fp8_models import make_fp8_llama

    start = pool.workdir / "fp8_llama"
    if not (start / "tiny_model.json").exists():  # written last
        make_fp8_llama(start)
    return delta_server(pool, start)
