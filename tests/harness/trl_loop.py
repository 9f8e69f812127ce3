"""TRL's real `GRPOTrainer` in server mode against a delta engine, checked after every weight sync.

Why in the harness: `make demo-trl` (examples/delta_weight_sync/trl_grpo_demo.py, its own engine) and
tests/integrations/test_trl.py (the pool's engine) run the same loop. After each sync the trained model
is written by transformers' `save_pretrained`, loaded afresh by vLLM's own loader (`digests_of`) and
compared with the engine's `/weight_checker` digests.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.engine_pool import checksums, status
from harness.tiny_models import PROMPTS

Digests = Callable[[Path], dict[str, str]]


def reward_vowels(completions: list[str], **_: Any) -> list[float]:
    """Deterministic: the share of vowels in the completion (GRPO needs the rewards of a group to differ)."""
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


def run_grpo(
    url: str,
    delta_root: Path,
    model_dir: Path,
    work: Path,
    steps: int,
    digests_of: Digests,
    api_key: str | None = None,
    lr: float = 1e-5,
    then: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """`steps` GRPO steps on CPU, rollouts from the engine at `url` fed by deltas; one row per sync.
    `then(client)` runs after the last sync, before the client closes."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from vllm_delta.integrations.trl import use_delta

    # The one line a TRL user adds. The versions start above the engine's: a shared test engine may have
    # synced before (from a run that restarts against a live engine, as a resumed trainer would).
    use_delta(str(delta_root), api_key=api_key, version=status(url, api_key)["version"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    full_sync = sum(p.numel() * p.element_size() for p in model.parameters())  # what TRL's NCCL sync ships
    args = GRPOConfig(
        output_dir=str(work / "grpo"),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=60,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=lr,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_vowels,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    client = trainer.vllm_generation.vllm_client
    syncs: list[dict[str, Any]] = []
    sync = client.update_named_params

    def checked(metadata, named_params) -> None:  # TRL's own sync, then the check
        sync(metadata, named_params)
        m = client.last_metrics
        saved = work / f"sync{len(syncs)}"
        model.save_pretrained(saved)
        for f in model_dir.iterdir():
            if "token" in f.name:
                shutil.copy2(f, saved / f.name)
        syncs.append(
            {
                "step": trainer.state.global_step,
                "anchor": m.get("sender/anchors", 0.0) > 0,
                "wire_bytes": int(m.get("perf/update_weights_wire_bytes", 0)),
                "full_sync_bytes": full_sync,
                "density": m.get("perf/update_weights_density", 0.0),
                "acked": m.get("sender/all_acked") == 1.0,
                "exact": checksums(url, api_key) == digests_of(saved),
            }
        )
        shutil.rmtree(saved)

    client.update_named_params = checked
    trainer.train()
    trainer.vllm_generation.sync_weights()  # the last step's weights reach the engine too
    deltas = [s for s in syncs if not s["anchor"]]
    client.update_named_params = sync
    failed = client.failures  # the loop's own; `then` may add its own
    if then is not None:
        then(client)
    client.close_communicator()
    return {
        "steps": trainer.state.global_step,
        "syncs": len(syncs),
        "exact_after_every_sync": all(s["exact"] for s in syncs),
        "all_acked": all(s["acked"] for s in syncs),
        "failed_syncs": failed,
        "full_sync_bytes": full_sync,
        "delta_bytes_per_sync": [s["wire_bytes"] for s in deltas],
        "bytes_vs_full": [round(s["wire_bytes"] / full_sync, 5) for s in deltas],
        "density_per_step": [round(s["density"], 6) for s in deltas],
        "rewards": [round(x["reward"], 4) for x in trainer.state.log_history if "reward" in x],
        "per_sync": syncs,
    }
