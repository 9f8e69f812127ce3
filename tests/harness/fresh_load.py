"""Reference digests from a fresh load by vLLM's own model loader, in a process of its own.

Why: a synced engine is checked against weights loaded afresh from a checkpoint by code other than
ours. Starting a whole `vllm serve` for that costs an engine start; vLLM's `get_model` on the same
checkpoint, configured as a delta engine is (the plugin loaded, the delta flag set), produces the
same parameters, and vLLM's `compute_tensor_digests` is what `/weight_checker` returns (checked
against a real `vllm serve` in tests/engine/test_fresh_load.py). The loads run in one child process
per session: vLLM's process-wide state (distributed groups, the current config, the plugin's
post-load observers) never leaks into the test process, and vLLM is imported once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from safetensors.torch import save_file

from harness.vllm_engine import MAX_MODEL_LEN, engine_env, free_port, patched_environ, with_engine_site
from vllm_delta.engine.cli_args import ENV_FLAG

# What a TP=1 worker prefixes its digests with (vLLM's `Worker._weight_checksum_prefix`).
PREFIX = "dp0:pp0:pcp0:tp0:"


def save_checkpoint(weights: Mapping[str, torch.Tensor], like: Path, out: Path) -> Path:
    """`weights` as one safetensors file beside `like`'s config and tokenizer files: a checkpoint to load."""
    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, out / "model.safetensors")
    return out


class FreshLoader:
    """`loader.checksums(model_dir)`: `/weight_checker` digests of a TP=1 delta engine freshly loaded
    from `model_dir`, by a child process that loads one checkpoint per call."""

    def __init__(self) -> None:
        self._conn, child = mp.get_context("spawn").Pipe()
        self._proc = mp.get_context("spawn").Process(target=_serve, args=(child,), daemon=True)
        with patched_environ({"PYTHONPATH": with_engine_site(os.environ.get("PYTHONPATH"))}):
            self._proc.start()  # the child starts as an engine's processes do (harness/engine_site)
        child.close()

    def checksums(self, model_dir: Path | str) -> dict[str, str]:
        self._conn.send(str(model_dir))
        ok, result = self._conn.recv()
        if not ok:
            raise RuntimeError(f"fresh load of {model_dir} failed:\n{result}")
        return result

    def close(self) -> None:
        self._conn.close()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


def _serve(conn: Connection) -> None:
    """The child: configure like a delta engine's worker, then load each checkpoint it is sent."""
    os.environ.update({**engine_env(1), ENV_FLAG: "1"})
    import traceback

    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from harness import fp8_kernel

    fp8_kernel.install()  # block-fp8 checkpoints load on CPUs without AMX too (its docstring)
    load_general_plugins()
    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before it loads
    while True:
        try:
            model_dir = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, _load_and_digest(model_dir)))
        except Exception:  # reported to the test, which raises it
            conn.send((False, traceback.format_exc()))


def _load_and_digest(model_dir: str) -> dict[str, str]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    config = EngineArgs(
        model=model_dir, dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=MAX_MODEL_LEN
    ).create_engine_config()
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per child: TP=1 on a gloo group of one
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            )
            ensure_model_parallel_initialized(1, 1)
        model = get_model(vllm_config=config)
    return {PREFIX + name: digest for name, digest in compute_tensor_digests(model).items()}
