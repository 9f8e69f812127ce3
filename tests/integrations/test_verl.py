"""verl 0.9.1 loads our `CheckpointEngine` through `custom_backend_module` and syncs a real engine.

verl runs beside the venv, not in it (harness/rl_frameworks.py: it pins transformers < 5.11 and needs
ray), so tests/integrations/verl_check.py runs in a child process with verl on its path, against the
session's shared Llama engine. The engine must end bit-exact with a fresh load of the trainer's export.
"""

from __future__ import annotations

import pytest
from harness import rl_frameworks
from harness.engine_pool import API_KEY, checksums, reset_to_checkpoint, status
from harness.fresh_load import save_checkpoint
from safetensors.torch import load_file

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


@rl_frameworks.installed
def test_verl_checkpoint_engine_syncs_exactly(engine_pool, tiny_model_factory, fresh_loader, tmp_path):
    model_dir = tiny_model_factory("llama")
    server = engine_pool.shared_llama(model_dir)
    root = engine_pool.delta_root()
    version = reset_to_checkpoint(server, root, model_dir)
    out = tmp_path / "export.safetensors"
    args = [server.url, str(root), str(model_dir), API_KEY, str(version), str(out)]
    report = rl_frameworks.run_check("verl_check.py", *args)
    assert report["received"] == [] and len(report["metrics"]) == 2, report
    assert status(server.url)["version"] == version + 2, report["metrics"]
    export = save_checkpoint(load_file(out), like=model_dir, out=tmp_path / "export")
    assert checksums(server.url) == fresh_loader.checksums(export), report["metrics"]
