"""verl 0.9.1 loads our `CheckpointEngine` through `custom_backend_module` and syncs a real engine.

verl pins transformers < 5.11 (this venv serves 5.19) and needs ray, so it runs in its own venv,
`make rl-venv` (.venv-verl: verl from pip, everything else from the main venv's site-packages);
tests/integrations/verl_check.py runs there against the session's shared Llama engine. The engine
must end bit-exact with a fresh load of the trainer's export.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness.engine_pool import API_KEY
from harness.fresh_load import save_checkpoint
from safetensors.torch import load_file

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-rl" / "bin" / "python"


@pytest.mark.skipif(
    not VERL_PYTHON.exists(), reason="the RL frameworks' venv is made by `make rl-venv` (not in make test)"
)
def test_verl_checkpoint_engine_syncs_exactly(
    delta_server, deltas, fresh_loader, tiny_model_factory, tmp_path
):
    model_dir = tiny_model_factory("llama")
    out = tmp_path / "export.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run(
        [
            str(VERL_PYTHON),
            str(ROOT / "tests" / "integrations" / "verl_check.py"),
            delta_server.url,
            str(deltas.root),
            str(model_dir),
            API_KEY,
            str(delta_server.status()["version"]),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["received"] == [] and len(report["metrics"]) == 2, report
    export = save_checkpoint(load_file(out), like=model_dir, out=tmp_path / "export")
    assert delta_server.checksums() == fresh_loader.checksums(export), report["metrics"]
