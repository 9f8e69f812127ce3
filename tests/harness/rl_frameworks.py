"""verl 0.9.1 and SkyRL 0.4.0 as `make install` puts them: beside the venv (`<venv>/rl-frameworks`).

Why beside: verl pins transformers < 5.11 and needs ray (vLLM imports ray in every engine once it is
installed); SkyRL 0.4.0 asks Python >= 3.12 and its wheel brings top-level `tests` and `scripts`
packages. So their pinned wheels are installed without dependencies into a directory of their own
(Makefile: RL_SITE), and only what uses them reaches it: verl's check runs in a child process with
that directory on its path; SkyRL's two weight-sync modules (they import nothing else of SkyRL, and
run on 3.11) are loaded from its wheel by path, in the test's own process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SITE = Path(sys.prefix) / "rl-frameworks"
REPO = Path(__file__).resolve().parents[2]
installed = pytest.mark.skipif(
    not SITE.is_dir(), reason=f"verl and SkyRL are installed by `make install` into {SITE}"
)


def run_check(script: str, *args: str) -> dict:
    """tests/integrations/`script` in a child process with the frameworks on its path; its last line."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), str(SITE)])
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "integrations" / script), *args],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def skyrl_module(file: str) -> ModuleType:
    """skyrl/backends/skyrl_train/weight_sync/`file` of the installed SkyRL 0.4.0 wheel, as it ships."""
    (dist,) = importlib.metadata.distributions(name="skyrl", path=[str(SITE)])
    assert dist.version == "0.4.0", dist.version
    path = dist.locate_file(f"skyrl/backends/skyrl_train/weight_sync/{file}")
    spec = importlib.util.spec_from_file_location(f"skyrl_{file[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
