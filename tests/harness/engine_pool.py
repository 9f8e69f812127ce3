"""Engines shared by the whole test session, keyed by model and configuration.

Why: an engine start is the largest cost of the suite on 2 cores. Modules that need the same
engine (the same checkpoint, TP size, flags and environment) take it from the pool instead of
starting their own, and a module that needs the engine on its checkpoint asks for a reset: a
full anchor of the checkpoint at the engine's next version, so it starts from known weights
whatever the modules before it left (its own checks are then made against fresh loads, not
against this reset).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import requests
import torch

from harness import commit_fault
from harness.vllm_engine import VllmServer
from vllm_delta.wire import DeltaWriter
from vllm_delta.wire.checkpoint import Checkpoint

API_KEY = "pool-test-key"  # every pooled delta engine's key
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# The shared Llama engine has the test-only commit fault armed (harness/commit_fault.py) at a version
# no other module reaches: tests/engine/test_prepare_while_serving.py makes it fail there for real.
FAULT_VERSION = 999_000_000
FAULT_AT = "model.layers.1.mlp.down_proj.weight"  # a live tensor written after layer 0's
# Idle keep-alive connections are kept 120 s (vLLM's default is 5 s) for tests/reliability/test_soak.py.
KEEP_ALIVE_S = "120"


class EnginePool:
    """`pool.get(model_dir, ...)`: a running `vllm serve`, started on first use, stopped at session end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._servers: dict[tuple, VllmServer] = {}

    def get(
        self, model_dir: Path, tp: int = 1, extra_args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> VllmServer:
        key = (str(model_dir), tp, tuple(extra_args), tuple(sorted((env or {}).items())))
        server = self._servers.get(key)
        if server is None or server.proc.poll() is not None:  # first use, or a test stopped it
            log = self.workdir / f"engine{len(self._servers):02d}.log"
            server = self._servers[key] = VllmServer(
                model_dir, log, tp=tp, extra_args=list(extra_args), env=env
            )
        return server

    def delta_root(self) -> Path:
        """The delta root every pooled delta engine serves (modules write their deltas under it)."""
        root = Path(os.path.realpath(self.workdir / "delta_root"))
        root.mkdir(exist_ok=True)
        return root

    def delta_engine(
        self, model_dir: Path, tp: int = 1, extra_args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> VllmServer:
        """`vllm serve --enable-delta-updates` on the pool's root with the pool's key, and any further
        flags."""
        args = [
            "--enable-delta-updates",
            "--delta-updates-root",
            str(self.delta_root()),
            "--api-key",
            API_KEY,
            *extra_args,
        ]
        return self.get(model_dir, tp, args, env)

    def shared_llama(self, model_dir: Path) -> VllmServer:
        """The delta engine most modules share: the tiny Llama at TP=1, plain delta flags, fault armed,
        the seed's manifest-less format allowed (tests/engine/test_seed_push.py pushes the seed's files)."""
        return self.delta_engine(
            model_dir,
            extra_args=["--delta-updates-allow-seed-format"],
            env={
                **commit_fault.engine_env(FAULT_VERSION, FAULT_AT),
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": KEEP_ALIVE_S,
            },
        )

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()


def write_anchor(path: Path, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
    """A full overwrite of every tensor (stating no digests): valid on any weights, and repairs a fault."""
    with DeltaWriter(path, version=version, base_version=None, encoding="indices") as writer:
        for name, t in weights:
            writer.add(name, torch.arange(t.numel()), t.reshape(-1), shape=tuple(t.shape))
    return path


def reset_to_checkpoint(server: VllmServer, root: Path, model_dir: Path) -> int:
    """Put `server` back on `model_dir`'s weights, as a fresh engine on that checkpoint would be apart
    from its version: a full anchor (stating no digests, so a later full verify checks only what the
    module's own updates state) at its next version, deleted once applied. An engine that has committed
    nothing and is healthy is left alone. Returns the version it is at."""
    st = status(server.url)
    if st["version"] == 0 and st["healthy"]:
        return 0
    version = st["version"] + 1
    path = write_anchor(
        root / f"reset-{uuid.uuid4().hex[:8]}", Checkpoint.open(model_dir).iter_tensors(), version
    )
    r = requests.post(
        f"{server.url}/update_weights_delta",
        json={"path": path.name, "version": version},
        headers=HEADERS,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert status(server.url)["version"] == version
    shutil.rmtree(path)  # applied; a pooled root outlives many modules (the engine pair's is a small tmpfs)
    return version


def _auth(api_key: str | None = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def status(url: str, api_key: str | None = API_KEY) -> dict:
    """The engine's `/delta_updates/status` (the pool's key by default; `None` for an engine without one)."""
    r = requests.get(f"{url}/delta_updates/status", headers=_auth(api_key), timeout=60)
    r.raise_for_status()
    return r.json()


def checksums(url: str, api_key: str | None = API_KEY) -> dict[str, str]:
    """vLLM's own per-parameter digests of the served weights (`/weight_checker`)."""
    r = requests.post(
        f"{url}/weight_checker", json={"action": "checksum"}, headers=_auth(api_key), timeout=120
    )
    r.raise_for_status()
    return r.json()["checksums"]
