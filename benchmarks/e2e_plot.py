"""Stacked per-phase bars of `benchmarks/e2e_sync.py --json` runs (slowest rank's trace of each push), with
vLLM's `reload_weights` median and the 0.15x target as lines: where a sync's time goes, run by run.

    python benchmarks/e2e_plot.py OUT.png LABEL=RUN.json [LABEL=RUN.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Ours, then vLLM's CPU kernel work (prebuild: the oneDNN re-pack built ahead; post_load: steps in the pause).
OURS = [
    "receive",
    "decode",
    "locate",
    "stage",
    "prepare_wait",
    "scatter",
    "read_back",
    "pause",
    "commit_wait",
]
VLLM = ["prebuild", "post_load"]


def main(out: str, runs: list[str]) -> None:
    bars, labels, reloads = [], [], []
    for arg in runs:
        label, path = arg.split("=", 1)
        run = json.load(open(path))
        reloads.append(statistics.median(run["reload_s"]))
        for push in run["pushes"]:
            bars.append(push["trace"]["phases"])
            labels.append(f"{label}\n{push['density']:.1%}")
    fig, ax = plt.subplots(figsize=(1.1 * len(bars) + 3, 5))
    colors = plt.get_cmap("tab20").colors
    for i, phase in enumerate(OURS + VLLM):
        heights = [b.get(phase, 0.0) for b in bars]
        bottoms = [sum(b.get(p, 0.0) for p in (OURS + VLLM)[:i]) for b in bars]
        ax.bar(
            range(len(bars)),
            heights,
            bottom=bottoms,
            color=colors[i],
            label=phase,
            hatch="//" * (phase in VLLM),
        )
    target = 0.15 * statistics.median(reloads)
    ax.axhline(target, color="red", linestyle="--", label=f"0.15x reload_weights ({target:.2f} s)")
    ax.set_xticks(range(len(bars)), labels, fontsize=8)
    ax.set_ylabel("seconds (slowest rank's phases)")
    ax.set_title("Delta sync end to end, Qwen3-235B tensor counts (36,945), real vllm serve over HTTP")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
