"""Real vLLM engines for tests: in-process `LLM` and `vllm serve` as a subprocess.

Why: every apply path is checked on a real engine. These helpers hold the settings a 2-core,
24 GiB CPU machine needs (small KV cache, eager mode, OpenMP binding per TP rank) in one place.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from vllm_delta.engine.cli_args import ENV_FLAG as DELTA_ENV
from vllm_delta.engine.cli_args import WORKER_EXTENSION as DELTA_WORKER_EXTENSION

KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 256
VENV_BIN = Path(sys.executable).parent
# Every engine process runs this site first (its docstring says what it does: a lighter start, no patch).
ENGINE_SITE = str(Path(__file__).resolve().parent / "engine_site")


def engine_env(tp: int = 1, dev_mode: bool = True) -> dict[str, str]:
    """Environment for an engine at this TP size on this machine."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's own default: importing TRL sets os.environ's VLLM_LOGGING_LEVEL to ERROR (trl/_compat.py),
        # and every engine started later in that pytest worker would log no INFO line (startup, plugins).
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    # One core per TP rank; at TP=1 vLLM's auto binding keeps a core for the front end.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp)) if tp > 1 else "auto"
    return env


def with_engine_site(pythonpath: str | None) -> str:
    """`pythonpath` with the engine site first (a test's own site, if any, runs after it)."""
    return os.pathsep.join(p for p in (ENGINE_SITE, pythonpath) if p)


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (engine subprocesses inherit them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# Test-only: a torch fused-MoE forward that honours the expert map, for EP engines (see its docstring).
TORCH_MOE = str(Path(__file__).resolve().parent / "torch_moe")


@contextlib.contextmanager
def start_llm(model_dir: Path | str, tp: int = 1, delta: bool = False, **engine_kwargs) -> Iterator[object]:
    """Start an in-process `vllm.LLM` on the CPU and shut it down afterwards.

    `delta=True` turns delta updates on the way `--enable-delta-updates` does: the worker
    extension, and the environment flag that keeps CPU-repacked weights updatable.
    """
    env = engine_env(tp)
    if delta:
        env[DELTA_ENV] = "1"
        engine_kwargs.setdefault("worker_extension_cls", DELTA_WORKER_EXTENSION)
    pythonpath = os.environ.get("PYTHONPATH")
    if engine_kwargs.get("enable_expert_parallel"):
        pythonpath = os.pathsep.join(p for p in (TORCH_MOE, pythonpath) if p)
    env["PYTHONPATH"] = with_engine_site(pythonpath)
    with patched_environ(env):
        from vllm import LLM

        llm = LLM(
            model=str(model_dir),
            dtype=engine_kwargs.pop("dtype", "bfloat16"),
            tensor_parallel_size=tp,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            enforce_eager=True,
            seed=0,
            **engine_kwargs,
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """`vllm serve MODEL` as a real subprocess: free port, health wait, log capture, clean stop."""

    def __init__(
        self,
        model_dir: Path | str,
        log_path: Path,
        tp: int = 1,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        launcher: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        """`launcher`: what runs in place of `vllm serve MODEL` (e.g. `trl vllm-serve --model MODEL`);
        `port`: the port to serve on (an engine restarted in place), else a free one."""
        self.log_path = log_path
        full_env = {**os.environ, **engine_env(tp), **(env or {})}
        full_env["PYTHONPATH"] = with_engine_site(full_env.get("PYTHONPATH"))
        for attempt in range(PORT_ATTEMPTS):
            # A free port can be taken before vLLM binds it (the kernel hands ephemeral ports to
            # other processes' client sockets too): that start is retried on another port.
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [
                *(launcher or [str(VENV_BIN / "vllm"), "serve", str(model_dir)]),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
                "--tensor-parallel-size", str(tp),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                *(extra_args or []),
            ]  # fmt: skip
            self._log = open(log_path, "wb")
            self.proc = subprocess.Popen(
                cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
            try:
                self._wait_healthy(startup_timeout_s)
                return
            except BaseException as exc:
                self.stop()
                if attempt + 1 == PORT_ATTEMPTS or "Address already in use" not in str(exc):
                    raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)  # a 1 s poll cost each of the suite's ~40 engine starts 0.5 s on average
        raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server's whole process group (API server, engine core, workers)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def complete(self, prompt: str, max_tokens: int = 8, **extra) -> dict:
        """Greedy completion through the OpenAI route, with logprobs."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}
        resp = requests.post(f"{self.url}/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        return resp.json()["choices"][0]


def start_servers(*starts: Callable[[], VllmServer]) -> list[VllmServer]:
    """Start several `VllmServer`s at once, in threads; returns them in order.

    Why: about half of a CPU engine's start is waiting (process spawns, handshakes, the health poll),
    so two started together are healthy well before two started one after the other. If any start
    fails, the ones that came up are stopped and the first error is raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise errors[0]
    return [f.result() for f in futures]


def served_greedy(
    url: str, headers: dict[str, str] | None = None, prompts: Sequence[str] | None = None, max_tokens: int = 8
) -> list[tuple[list[str], list[float]]]:
    """Each prompt's greedy tokens and their logprobs from a server, one prompt per request (the bit-exactness
    checks' output half over HTTP). One at a time: vLLM's CPU kernels round by batch shape (its fp8 kernel
    moved a stock engine's first logprob -4.488667 -> -4.487775 between calls that batched the prompts
    differently); alone, each is computed alike. A fresh cache salt per request: nothing is read from a
    prefix cached under other weights."""
    from harness.tiny_models import PROMPTS

    out = []
    for prompt in prompts or PROMPTS:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "seed": 0,
            "cache_salt": uuid.uuid4().hex,
        }
        r = requests.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def greedy(llm, prompts: list[str] | None = None) -> list[tuple[list[int], list[float]]]:
    """Each prompt's 8 greedy tokens and their logprobs from an in-process `LLM` (the bit-exactness checks'
    output half: equal weights must give equal tokens and logprobs)."""
    from vllm import SamplingParams

    from harness.tiny_models import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    return [
        (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for c in (r.outputs[0] for r in llm.generate(prompts or PROMPTS, params, use_tqdm=False))
    ]
