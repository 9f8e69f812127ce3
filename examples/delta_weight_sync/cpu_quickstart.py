#!/usr/bin/env python3
"""CPU quick start: a plain PyTorch trainer syncs a real `vllm serve --enable-delta-updates` engine.

It builds a tiny random Llama, starts the engine exactly as a user would, then trains the same
weights with AdamW (lr 1e-5) and calls `DeltaSender.sync` after every step over the disk
transport. Each update carries digests that the engine checks before writing. `bitexact` comes
from an independent comparison: transformers' own `save_pretrained` of the trained model, loaded
into a fresh engine, must give the same per-parameter `/weight_checker` digests and the same
greedy completion as the synced engine. The last line printed is one JSON summary; its
`full_sync_bytes` is what full syncs of the same count would move (every synced tensor at its dtype),
counted from the trainer's state dict, not by the delta code.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builder and server harness live with the tests

from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402

from vllm_delta import DeltaSender  # noqa: E402

STEPS = 3


def checksums(url: str) -> dict[str, str]:
    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=120)
    r.raise_for_status()
    return r.json()["checksums"]


def full_sync_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of one full sync: every tensor the trainer hands the sender, at its dtype."""
    return sum(t.numel() * t.element_size() for t in state.values())


def train_step(model, optimizer, gen: torch.Generator) -> float:
    ids = torch.randint(3, 512, (2, 24), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def main() -> int:
    from transformers import LlamaForCausalLM

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="vllm-delta-demo-"))
    model_dir = make_tiny_model("llama", work / "model")
    root = work / "deltas"
    root.mkdir()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    steps = []
    with VllmServer(
        model_dir,
        work / "serve.log",
        extra_args=["--enable-delta-updates", "--delta-updates-root", str(root)],
    ) as server:
        sender = DeltaSender([server.url], transport="disk", delta_dir=root, encoding="ulp_zstd")
        sender.seed_from_checkpoint(model_dir)
        for step in range(1, STEPS + 1):
            loss = train_step(model, optimizer, gen)
            state = model.state_dict()
            m = sender.sync((n, p.detach()) for n, p in state.items())
            steps.append(
                {
                    "step": step,
                    "loss": round(loss, 4),
                    "density": round(m["perf/update_weights_density"], 5),
                    "wire_bytes": int(m["perf/update_weights_wire_bytes"]),
                    "full_sync_bytes": full_sync_bytes(state),
                    "sync_s": round(m["perf/update_weights_time"], 3),
                    "all_acked": m["sender/all_acked"] == 1.0,
                }
            )
            print(f"step {step}: {steps[-1]}", flush=True)
        status = requests.get(f"{server.url}/delta_updates/status", timeout=30).json()
        completion = server.complete("The quick brown fox", max_tokens=8)
        synced = checksums(server.url)
    # Independent check: transformers writes the trained weights; a fresh engine loads them.
    trained = work / "trained"
    model.save_pretrained(trained)
    for f in model_dir.iterdir():
        if "token" in f.name:
            shutil.copy2(f, trained / f.name)
    with VllmServer(
        trained, work / "fresh.log", extra_args=["--enable-delta-updates", "--delta-updates-root", str(root)]
    ) as fresh:
        bitexact = (
            checksums(fresh.url) == synced
            and fresh.complete("The quick brown fox", max_tokens=8)["text"] == completion["text"]
        )
    full_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    summary = {
        "demo": "cpu_quickstart",
        "model": "tiny-llama (random bf16)",
        "trainer": "AdamW lr 1e-5",
        "bitexact": bitexact,
        "engine_version": status["version"],
        "healthy": status["healthy"],
        "syncs": len(steps),
        "all_acked": all(s["all_acked"] for s in steps),
        "wire_bytes_total": sum(s["wire_bytes"] for s in steps),
        "full_sync_bytes": sum(s["full_sync_bytes"] for s in steps),
        "full_checkpoint_bytes": full_bytes,
        "served_text": completion["text"],
        "steps": steps,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0 if bitexact and summary["healthy"] and summary["all_acked"] and status["version"] == STEPS else 1


if __name__ == "__main__":
    sys.exit(main())
