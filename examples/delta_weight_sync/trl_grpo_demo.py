#!/usr/bin/env python3
"""`make demo-trl`: TRL's real `GRPOTrainer` trains a tiny Llama for a few CPU steps, its rollouts from a real
`vllm serve` fed by deltas through vLLM's weight-transfer API with our backend.

The server is TRL's own `trl vllm-serve --model MODEL ...` with `--weight-transfer-config '{"backend":
"vllm_delta"}' --delta-updates-root DIR` (our backend in place of TRL's NCCL); the trainer adds one line,
`use_delta(DIR)`. The reward is deterministic (the share of vowels in a completion); the sampling is real,
so the change density of each step is what GRPO produced. After every sync the engine's `/weight_checker`
digests are compared with a fresh load (vLLM's own loader) of the trainer's `save_pretrained`. The last
line printed is JSON (harness/trl_loop.py says what each field is).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builder and the engine harness live with the tests
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p
)

from harness.fresh_load import FreshLoader  # noqa: E402
from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.trl_loop import run_grpo  # noqa: E402
from harness.vllm_engine import VENV_BIN, VllmServer  # noqa: E402

STEPS = 3


def main() -> int:
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-delta-trl-"))
    model_dir = make_tiny_model("llama", work / "model")
    root = work / "deltas"
    root.mkdir()
    backend = [
        "--weight-transfer-config",
        json.dumps({"backend": "vllm_delta"}),
        "--delta-updates-root",
        str(root),
    ]
    loader = FreshLoader()
    try:
        trl_serve = [str(VENV_BIN / "trl"), "vllm-serve", "--model", str(model_dir)]
        with VllmServer(model_dir, work / "serve.log", extra_args=backend, launcher=trl_serve) as server:
            out = run_grpo(server.url, root, model_dir, work, STEPS, loader.checksums)
    finally:
        loader.close()
    summary = {
        "demo": "trl_grpo",
        "trainer": "trl.GRPOTrainer (vllm_mode=server) + vllm_delta.integrations.trl.use_delta",
        "server": "trl vllm-serve --weight-transfer-config {backend: vllm_delta}",
        "model": "tiny-llama (random bf16)",
        **{k: v for k, v in out.items() if k != "per_sync"},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    ok = summary["exact_after_every_sync"] and summary["all_acked"] and summary["steps"] == STEPS
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
