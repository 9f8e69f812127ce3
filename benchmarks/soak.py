"""Reliability soak: syncs under concurrent completion streams against a real CPU `vllm serve`.

Writes docs/results/reliability.md and reliability.json: syncs verified (the engine's own full
verify against each update's digests, and those digests against a fresh digest of the trainer's
weights), requests failed, p50/p99 latency with and without syncing, and the pause per sync.
The same run, 10 syncs long, is `tests/reliability/test_soak.py` in `make test`.

Run: .venv/bin/python benchmarks/soak.py [--syncs 100] [--streams 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.soak import run_soak  # noqa: E402
from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402

API_KEY = "soak-benchmark-key"
# The fault cases, each a test with real processes (tests/reliability/test_faults.py); the soak
# figures above come from this script, the fault outcomes from those tests in `make test`.
FAULTS = [
    (
        "an engine restarted silently on the same port after acking v > S, while another lags",
        "refuses the overwrite catch-up (409 LineageError), is anchored, converges",
        "test_engine_restarted_silently_refuses_the_catchup_and_is_anchored",
    ),
    (
        "an engine SIGKILLed with an update in flight, then restarted",
        "anchored at the next sync, converges",
        "test_engine_killed_with_an_update_in_flight_is_anchored",
    ),
    (
        "a sender SIGKILLed at 3 random points while writing",
        "nothing applicable (400 IncompleteDeltaError, digests unchanged) or a whole anchor",
        "test_sender_killed_at_random_points_never_leaves_an_engine_on_partial_weights",
    ),
    (
        "the delta root (a 16 MiB tmpfs) fills up mid-write",
        "the sync raises ENOSPC, no engine changes, the next sync converges",
        "test_disk_full_mid_write_applies_nothing_and_recovers",
    ),
    (
        "one of two engines unreachable for 3 syncs (max_lag_syncs=2), then back",
        "dropped to needs-anchor, the other keeps base-relative deltas, then anchored",
        "test_engine_unreachable_for_k_syncs_is_dropped_then_anchored",
    ),
]


def report(f: dict, load_note: str) -> str:
    base, busy = f["latency_baseline"], f["latency_syncing"]
    return "\n".join(
        [
            "# Reliability: syncs under load",
            "",
            f"Machine: {os.cpu_count()} CPU cores, no GPU; {load_note}. Engine: tiny Llama (the test suite's), "
            f"`vllm serve --enable-delta-updates --api-key`, TP=1. Trainer: the checkpoint's tensors, {f['syncs']} "
            "syncs of small ULP steps (mostly ±1-2, some larger) at 2% density over disk, while "
            f"{f['streams']} threads issue greedy completions back to back. "
            "Reproduce: `.venv/bin/python benchmarks/soak.py`.",
            "",
            "| | figure |",
            "|---|---|",
            f"| syncs | {f['syncs']} |",
            f"| syncs verified (engine full verify == update digests == fresh trainer digests) | "
            f"{f['syncs_verified']} |",
            f"| digest-chain errors | {len(f['chain_errors'])} |",
            f"| requests | {f['requests']} |",
            f"| requests failed | {f['requests_failed']} |",
            f"| latency without syncing, p50 / p99 | {base['p50'] * 1e3:.0f} / {base['p99'] * 1e3:.0f} ms "
            f"({base['n']} requests) |",
            f"| latency while syncing, p50 / p99 | {busy['p50'] * 1e3:.0f} / {busy['p99'] * 1e3:.0f} ms "
            f"({busy['n']} requests) |",
            f"| engine pause per sync, median / max | {f['pause_s']['median'] * 1e3:.0f} / "
            f"{f['pause_s']['max'] * 1e3:.0f} ms |",
            f"| sync wall time, median | {f['sync_s']['median']:.2f} s |",
            "",
            "## Faults (real processes; each ends with equal `/weight_checker` digests on both engines and a "
            "passing full verify)",
            "",
            "| fault | outcome | test (`tests/reliability/test_faults.py`) |",
            "|---|---|---|",
            *[f"| {fault} | {outcome} | `{test}` |" for fault, outcome, test in FAULTS],
            "",
            "In none of these cases does an engine serve weights other than a version of the trainer's while "
            "healthy: a failed commit keeps it paused with `/health` 503 until an anchor (docs/receiver.md).",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=100)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--load-note", default="nothing else running")
    a = ap.parse_args()
    work = Path(os.path.realpath(tempfile.mkdtemp(prefix="soak-")))
    model = make_tiny_model("llama", work / "llama")
    root = work / "root"
    root.mkdir()
    args = ["--enable-delta-updates", "--delta-updates-root", str(root), "--api-key", API_KEY]
    with VllmServer(model, work / "serve.log", extra_args=args) as server:
        figures = run_soak(server.url, API_KEY, model, root, syncs=a.syncs, streams=a.streams, baseline_s=20)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "reliability.json").write_text(json.dumps(figures, indent=1))
    (a.out / "reliability.md").write_text(report(figures, a.load_note))
    print(json.dumps({k: figures[k] for k in ("syncs", "syncs_verified", "requests", "requests_failed")}))


if __name__ == "__main__":
    main()
