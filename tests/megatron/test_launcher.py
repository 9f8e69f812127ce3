"""The 16-node launcher's --dry-run: 8 rollout + 8 trainer nodes; every engine command is accepted by
vLLM's own `vllm serve` parser (with our flags plugin); trainers carry the layout and delta flags and
point at every engine; a layout that does not fit the node count is refused."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "examples/delta_weight_sync/launch.py"


def _dry_run(*flags: str) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, str(LAUNCHER), "--dry-run", *flags], capture_output=True, text=True, check=True
    ).stdout
    nodes = {}
    for line in out.splitlines():
        m = re.match(r"\[(\S+) @ (\S+)\] (.*)", line)
        assert m, line
        nodes[m.group(1)] = shlex.split(m.group(3))
    return nodes


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_dry_run_prints_8_trainer_and_8_rollout_nodes(monkeypatch, tmp_path):
    root = str(tmp_path)  # the engines' parser requires an existing root
    nodes = _dry_run("--delta-dir", root)
    assert sorted(nodes) == sorted([f"rollout-{i}" for i in range(8)] + [f"trainer-{i}" for i in range(8)])
    urls = [f"http://rollout-{i}:8000" for i in range(8)]
    for i in range(8):
        t = nodes[f"trainer-{i}"]
        assert t[0] == "torchrun" and _flag(t, "--node-rank") == str(i) and _flag(t, "--nnodes") == "8"
        assert (
            _flag(t, "--delta-mode"),
            _flag(t, "--delta-transport"),
            _flag(t, "--delta-encoding"),
            _flag(t, "--delta-dir"),
        ) == ("delta", "disk", "ulp_zstd", root)
        assert _flag(t, "--delta-engines").split(",") == urls
        tp, pp = (
            int(_flag(t, "--tensor-model-parallel-size")),
            int(_flag(t, "--pipeline-model-parallel-size")),
        )
        assert 64 % (tp * pp) == 0
    # Every engine command parses with vLLM's real `vllm serve` parser and our flags.
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    for i in range(8):
        r = nodes[f"rollout-{i}"]
        assert r[:2] == ["vllm", "serve"]
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(r[2:])
        assert ns.enable_delta_updates and str(ns.delta_updates_root) == root and ns.tensor_parallel_size == 8


def test_layout_that_does_not_fit_is_refused():
    r = subprocess.run(
        [sys.executable, str(LAUNCHER), "--dry-run", "--tp", "3"], capture_output=True, text=True
    )
    assert r.returncode != 0 and "does not divide" in r.stderr
