"""Block-fp8 engines for tests, on any CPU: the entry points that start them.

Why: vLLM 0.32 serves block fp8 on CPU only with AMX tiles unless the engine's processes carry the
test-only stand-in of `harness.fp8_kernel` (its docstring says what it changes: the AMX gate, no
more). Every fp8 engine a test starts comes from here, so none is started without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness import fp8_kernel
from harness.engine_pool import EnginePool
from harness.vllm_engine import VllmServer, patched_environ, start_llm


def delta_server(
    pool: EnginePool, model_dir: Path, tp: int = 1, extra_args: Sequence[str] = ()
) -> VllmServer:
    """The pool's `vllm serve --enable-delta-updates` on `model_dir` (dev mode: `/collective_rpc` too)."""
    return pool.delta_engine(model_dir, tp, extra_args, env=fp8_kernel.engine_env())


@contextlib.contextmanager
def llm(model_dir: Path, **kwargs) -> Iterator[object]:
    """An in-process `vllm.LLM` on `model_dir` (`harness.vllm_engine.start_llm`'s arguments)."""
    fp8_kernel.install()  # the engine core is forked from this process
    with patched_environ(fp8_kernel.engine_env()), start_llm(model_dir, **kwargs) as engine:
        yield engine
