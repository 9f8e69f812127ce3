"""`kernels.warmup.warm_up` compiles every kernel a sync runs: in a fresh interpreter, a sender's
scan and encode and an engine's apply after it add no signature to any kernel (`warm_check.py`,
which shows that without the sender's warm-up they would); with the kernels off it does nothing."""

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
    run = subprocess.run([sys.executable, str(script), "ulp_zstd"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_DELTA_KERNELS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {}


def test_nothing_with_the_kernels_off(monkeypatch):
    monkeypatch.setenv("VLLM_DELTA_KERNELS", "0")
    assert warm_up((torch.bfloat16,), sender=True) == 0.0
