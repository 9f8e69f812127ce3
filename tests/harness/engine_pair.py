"""Two tiny-Llama delta engines on one configuration, shared by the modules that need a pair.

Why: tests/reliability/test_faults.py and tests/sender/test_collective_engine.py each started two TP=1
engines (~52 s of a worker each), and tests/engine/test_security.py a third (~48 s). They differed only
in flags no test of the others minds, so they share one pair (tests/conftest.py makes them one xdist
scope, so one worker starts it): the root is a small tmpfs (test_faults fills it), the key is the pool's,
the collective allowlist names the local trainer (test_collective_engine) and the addresses
test_security refuses around, each collective flush is capped (test_collective_engine's per-flush cap)
and so is a request body (test_security). A test that kills or restarts an engine does it with
`restart`, which starts the new one on the same port in the same slot of `engines`, so the modules after
it find a pair; `live()` restarts one a failed test left dead.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
from pathlib import Path

from harness.engine_pool import API_KEY, reset_to_checkpoint
from harness.vllm_engine import VllmServer, start_servers
from vllm_delta import settings

ROOT_SIZE = "16m"  # small, so test_faults can fill it
COLLECTIVE_FLUSH_CAP = 64 << 10  # the engines' per-flush cap on the collective transport
MAX_BODY = 64 << 10  # the engines' request body cap
COLLECTIVE_TRAINERS = ("127.0.0.1", "10.9.8.0/24", "trainer.example")


class EnginePair:
    """`pair.engines`: two running `vllm serve --enable-delta-updates` of `model_dir` on `pair.root`."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.model_dir, self.workdir = model_dir, workdir
        self.root = Path(os.path.realpath(workdir / "root"))
        self.root.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", f"size={ROOT_SIZE}", "tmpfs", str(self.root)]
        self.mounted = subprocess.run(mount, capture_output=True).returncode == 0
        self.args = [
            "--enable-delta-updates",
            "--delta-updates-root",
            str(self.root),
            "--api-key",
            API_KEY,
            "--delta-updates-max-body-bytes",
            str(MAX_BODY),
            "--delta-updates-collective-trainers",
            *COLLECTIVE_TRAINERS,
        ]
        self.env = {settings.COLLECTIVE_MAX_FLUSH_BYTES: str(COLLECTIVE_FLUSH_CAP)}
        self._starts = itertools.count(1)  # one log per start; the pair's two start in two threads
        self.engines: list[VllmServer] = start_servers(self._serve, self._serve)

    def _serve(self, port: int | None = None) -> VllmServer:
        log = self.workdir / f"engine{next(self._starts):02d}.log"
        return VllmServer(self.model_dir, log, extra_args=self.args, env=self.env, port=port)

    def restart(self, i: int, kill: bool = False) -> VllmServer:
        """Stop engine `i` (SIGKILL to its process group, or a clean stop) and start it again on its port,
        on the checkpoint at version 0, in the same slot."""
        old = self.engines[i]
        if kill:
            os.killpg(old.proc.pid, signal.SIGKILL)
            old.proc.wait()
        old.stop()
        self.engines[i] = self._serve(old.port)
        return self.engines[i]

    def live(self) -> list[VllmServer]:
        """Both engines: started again if `stop` stopped them, one that a test left dead restarted."""
        if all(server.proc.poll() is not None for server in self.engines):
            self.engines[:] = start_servers(self._serve, self._serve)
        for i, server in enumerate(self.engines):
            if server.proc.poll() is not None:
                self.restart(i)
        return self.engines

    def on_checkpoint(self) -> list[VllmServer]:
        """Both engines live and back on the checkpoint's weights (`engine_pool.reset_to_checkpoint`)."""
        for server in self.live():
            reset_to_checkpoint(server, self.root, self.model_dir)
        return self.engines

    def stop(self) -> None:
        """Stop both engines (~4 GB of memory), keeping the root: `live` starts them again."""
        for server in self.engines:
            server.stop()

    def close(self) -> None:
        self.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], check=False)
