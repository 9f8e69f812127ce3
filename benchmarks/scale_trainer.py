"""The trainer half of the production-shape harness: `megatron_hook` registration on the worst rank at full shape.

Why: the reference job (`examples/delta_weight_sync/launch.py`) trains GLM-4.7-355B-A32B on 64 GPUs
at TP x PP x EP = 4 x 4 x 16; no CPU holds or spawns that. Each candidate rank is built for real by
mbridge + megatron-core with its weights on `meta` under a fake process group
(`tests/harness/megatron_meta.py`), and `hf_map.chunk_segments` (what `register()` runs) maps it.
The worst rank is the one that ships the most elements: TP rank 0 / DP rank 0 of some PP stage (it
also ships the replicated tensors; EP ranks hold equal expert counts), so each stage's first rank is
measured. Reported per stage: shipped elements, segments, HF runs, registration seconds and the
host memory registration added (peak RSS sampled every millisecond, minus RSS before it).

    python benchmarks/scale_trainer.py [--model glm-4.7-355b-a32b] [--json PATH] [--old-probe-layers N]

`--old-probe-layers N` also times the element-wise probe (the one this replaced) on the first
model's worst rank's first N decoder layers at full shape, for the before/after figures (it is
O(elements)). Seconds are wall time and the main thread's CPU time (the sampler thread excluded),
medians of `--repeats`; extra RSS is the largest over the repeats.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "megatron"), str(ROOT / "examples")]

from benchmarks.scale_configs import MODELS  # noqa: E402

# Megatron needs every PP stage to hold whole layers: 94 = 23 + 24 + 24 + 23 (first and last stages set).
_STAGES = {
    "qwen3-235b-a22b": {"num_layers_in_first_pipeline_stage": 23, "num_layers_in_last_pipeline_stage": 23}
}


def launcher_layout() -> dict[str, int]:
    """The launcher's defaults: world, TP, PP, EP, ETP."""
    from delta_weight_sync.launch import parse

    a = parse([])
    return {"world": a.trainer_nodes * a.gpus_per_node, "tp": a.tp, "pp": a.pp, "ep": a.ep, "etp": a.etp}


class PeakRSS:
    """Peak resident set size while the block runs, sampled every millisecond (torch's CPU allocations
    bypass tracemalloc, so RSS is what counts)."""

    def __init__(self) -> None:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.base = self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def register_rank(fields: dict, layout: dict, rank: int, probe=None, repeats: int = 1) -> dict:
    """Build `rank` on meta and map it as `register()` does, `repeats` times; what it cost and produced."""
    from harness.megatron_meta import meta_rank
    from megatron.core import parallel_state as ps

    from megatron_hook.hf_map import Parallel, chunk_segments

    with meta_rank(fields, rank=rank, **layout) as (gpt, bridge):
        par = Parallel.current()
        seconds, cpu, extra = [], [], []
        for _ in range(repeats):
            segs = None
            with PeakRSS() as mem:
                t0, c0 = time.perf_counter(), time.thread_time()
                segs = chunk_segments(bridge, gpt, par) if probe is None else probe(bridge, gpt, par)
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            extra.append(mem.extra)
        return {
            "rank": rank,
            "pp_stage": ps.get_pipeline_model_parallel_rank(),
            "tp_rank": par.tp_rank,
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "local_elements": sum(p.numel() for p in gpt.parameters()),
            "shipped_elements": sum(s.tensor.numel() for s in segs),
            "segments": len(segs),
            "runs": sum(len(s.runs) for s in segs),
            "hf_tensors": len({s.name for s in segs}),
            "seconds": statistics.median(seconds),
            "seconds_all": seconds,
            "cpu_seconds": statistics.median(cpu),
            "cpu_seconds_all": cpu,
            "extra_rss_bytes": max(extra),
            "extra_rss_all": extra,
        }


def stage_ranks(layout: dict[str, int]) -> list[int]:
    """The first rank of each PP stage (megatron's default order tp-cp-ep-dp-pp: pp is outermost)."""
    per_stage = layout["world"] // layout["pp"]
    return [s * per_stage for s in range(layout["pp"])]


def old_probe_layers(fields: dict, layout: dict, rank: int, layers: int, repeats: int) -> dict:
    """The element-wise probe on the first `layers` decoder layers of `rank`, at full shape."""
    from reference_probe import full_probe

    return register_rank(fields, layout, rank, _on_first_layers(full_probe, layers), repeats)


def register_rank_layers(fields: dict, layout: dict, rank: int, layers: int, repeats: int) -> dict:
    """The block probe on the same subset `old_probe_layers` maps (like for like)."""
    from megatron_hook.hf_map import probe

    return register_rank(fields, layout, rank, _on_first_layers(probe, layers), repeats)


def _on_first_layers(probe_fn, layers: int):
    """`chunk_segments` restricted to the rank's first `layers` decoder layers, with `probe_fn`."""
    from megatron_hook.hf_map import shipped

    def chunk(bridge, gpt, par):
        items = [
            (name, t, r, size)
            for name, t, r, size in shipped(bridge, gpt, par)
            if re.match(r"decoder\.layers\.\d+\.", name)
        ]
        first = sorted({int(re.match(r"decoder\.layers\.(\d+)\.", n).group(1)) for n, *_ in items})[:layers]
        keep = tuple(f"decoder.layers.{i}." for i in first)
        return [
            s
            for name, t, r, size in items
            if name.startswith(keep)
            for s in probe_fn(bridge, name, t, r, size)
        ]

    return chunk


def run(model: str, layout: dict | None = None, old_layers: int = 0, repeats: int = 3) -> dict:
    """Every stage's first rank once; the worst of them `repeats` times; optionally old vs new on a subset."""
    layout = dict(layout or launcher_layout())
    if model in _STAGES:
        layout["extra_args"] = _STAGES[model]
    fields = MODELS[model]
    stages = [register_rank(fields, layout, r) for r in stage_ranks(layout)]
    worst = register_rank(
        fields, layout, max(stages, key=lambda s: s["shipped_elements"])["rank"], repeats=repeats
    )
    out = {"model": model, "layout": layout, "stages": stages, "worst": worst}
    if old_layers:
        new = register_rank_layers(fields, layout, worst["rank"], old_layers, repeats)
        old = old_probe_layers(fields, layout, worst["rank"], old_layers, repeats)
        scale = worst["shipped_elements"] / old["shipped_elements"]
        out["old_probe"] = {
            "layers": old_layers,
            "new": new,
            "old": old,
            "elements_scale": scale,
            "projected_worst_seconds": old["seconds"] * scale,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), action="append")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--old-probe-layers", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    results = []
    models = args.model or ["glm-4.7-355b-a32b", "qwen3-235b-a22b", "deepseek-v3"]
    for model in models:
        try:
            r = run(
                model, old_layers=args.old_probe_layers if model == models[0] else 0, repeats=args.repeats
            )
        except Exception as e:  # a family the map cannot register yet: say so, measure the rest
            r = {"model": model, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        results.append(r)
        w = r.get("worst")
        print(
            json.dumps(
                {"model": model, "error": r["error"]}
                if w is None
                else {
                    "model": model,
                    "worst_rank": w["rank"],
                    "seconds": round(w["seconds"], 2),
                    "cpu_seconds": round(w["cpu_seconds"], 2),
                    "extra_rss_MiB": round(w["extra_rss_bytes"] / 2**20, 1),
                    "segments": w["segments"],
                    "runs": w["runs"],
                    "shipped_G": round(w["shipped_elements"] / 1e9, 3),
                }
            ),
            flush=True,
        )
        if "old_probe" in r:
            o = r["old_probe"]
            print(
                json.dumps(
                    {
                        "model": model,
                        "subset_layers": o["layers"],
                        "subset_G": round(o["old"]["shipped_elements"] / 1e9, 3),
                        "old_seconds": round(o["old"]["seconds"], 2),
                        "new_seconds": round(o["new"]["seconds"], 3),
                        "old_cpu_seconds": round(o["old"]["cpu_seconds"], 2),
                        "new_cpu_seconds": round(o["new"]["cpu_seconds"], 3),
                        "old_extra_rss_MiB": round(o["old"]["extra_rss_bytes"] / 2**20),
                        "new_extra_rss_MiB": round(o["new"]["extra_rss_bytes"] / 2**20, 1),
                        "old_projected_worst_seconds": round(o["projected_worst_seconds"]),
                    }
                ),
                flush=True,
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "host": {"cpus": os.cpu_count(), "threads": args.threads, "load_avg": os.getloadavg()},
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
