"""The GPU device check, run small on the CPU so it never rots (the same code path, tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a subprocess that runs the whole check

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


def test_device_check_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--tp",
            "2",
            "--densities",
            "0.02",
            "0.2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "device_check.json").read_text())
    apply = report["sections"]["apply"]
    assert apply["ok"] and apply["fallback"] == [] and [r["density"] for r in apply["rows"]] == [0.02, 0.2]
    assert all(
        r["bit_exact"] and r["digests_checked"] > 0 and r["device_decode_batches"] > 0 for r in apply["rows"]
    )
    assert "| 20.0% |" in (tmp_path / "device_check.md").read_text()
    sender = report["sections"]["sender"]
    assert sender["ok"] and [(r["snapshot"], r["density"]) for r in sender["rows"]] == [
        ("device", 0.02),
        ("device", 0.2),
        ("host", 0.02),
        ("host", 0.2),
    ]
    assert all(r["exact"] and r["changed"] > 0 for r in sender["rows"])
    assert "## sender" in (tmp_path / "device_check.md").read_text()
    collective = report["sections"]["collective"]
    assert collective["ok"] and collective["exact"] and collective["flushes"] > 0
    assert collective["pinned_window_bytes"] == collective["largest_flush"] <= collective["wire_bytes"]


def test_device_check_refuses_an_unknown_section(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--sections",
            "nope",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "unknown section 'nope'" in proc.stderr
