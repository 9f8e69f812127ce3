"""mypy passes on the wire format, the update transaction's core and the kernels (issue 30, "Habits").

Why a test: CI runs the suite, so a type error in these modules fails CI like a broken assertion.
The configuration is pyproject.toml's `[tool.mypy]`; its cache (.mypy_cache) makes a rerun take seconds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = [
    "vllm_delta/wire",
    "vllm_delta/engine/transaction.py",
    "vllm_delta/engine/messages.py",
    "vllm_delta/engine/trace.py",
    "vllm_delta/engine/replicas.py",
    "vllm_delta/kernels",
]


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)"
)
def test_mypy_passes_on_wire_engine_core_and_kernels():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
