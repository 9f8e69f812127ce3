"""`kernels.warmup.warm_up` compiles every kernel a sync runs: in a fresh interpreter, a sender's
scan and encode and an engine's apply after it add no signature to any kernel (`warm_check.py`,
which shows that without the sender's warm-up they would); with the kernels off it does nothing;
and where numba finds no writable cache directory the kernels still import and run, uncached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_delta.kernels import switch
from vllm_delta.kernels.warmup import warm_up

pytestmark = pytest.mark.skipif(not switch.HAVE_NUMBA, reason="numba is not installed")


@pytest.mark.heavy
def test_a_sync_after_warm_up_compiles_nothing():
    script = Path(__file__).with_name("warm_check.py")
    run = subprocess.run(
        [sys.executable, str(script), "ulp_zstd"],
        capture_output=True,
        text=True,
        timeout=600,
        # The script imports the suite's harness (tests/), which only pytest puts on the path.
        env={
            **os.environ,
            "VLLM_DELTA_KERNELS": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p
            ),
        },
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {}


def test_nothing_with_the_kernels_off(monkeypatch):
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert warm_up((torch.bfloat16,), sender=True) == 0.0


def test_kernels_run_uncached_where_no_cache_directory_is_writable():
    """numba's own decorator raises at import there ("no locator available"); `switch.kernel` compiles
    uncached instead. No locator is simulated by allowing only IPython's (outside IPython: none)."""
    code = (
        "import numpy as np; from vllm_delta.kernels import digest_jit; "
        "print(type(digest_jit.lane0._cache).__name__, digest_jit.lane0(np.uint64(0)))"
    )
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "IPythonCacheLocator"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["NullCache", "0"]
