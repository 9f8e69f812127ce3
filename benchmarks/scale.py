"""The receiver's startup at production shapes: GLM-4.7-355B, Qwen3-235B-A22B, DeepSeek-V3 (issue 16).

Full shapes, no values: vLLM's own model class is built on the `meta` device as one rank of a
TP=8 (or TP=8 + EP=8) layout - vLLM's parallel groups replaced by stand-ins that only answer
"world size 8, rank r" - and the receiver's real startup path runs on it: the batched placement
probe through the model's own `load_weights`, the cross-rank coverage check and the counted-once
analysis. The checkpoint's names and shapes come from transformers' model class on `meta`, saved
names as `save_pretrained` writes them (`revert_weight_conversion`). Every rank is probed (the
coverage check needs all of them); time and peak host memory are reported for the chosen rank.

    python benchmarks/scale.py [--models glm-4.7-355b-a32b ...] [--rank 7] [--json PATH]

Not in the checkpoint here: the MTP layer (`num_nextn_predict_layers`), which vLLM's main model
does not load (its tensors would be `ignored`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from benchmarks.scale_configs import MODELS, shrunk  # noqa: E402
from vllm_delta.engine.digests import Ownership, check_coverage, coverage  # noqa: E402
from vllm_delta.engine.placement import PeakRss, build_placement, storages_of  # noqa: E402

Checkpoint = dict[str, tuple[tuple[int, ...], torch.dtype]]
LAYOUTS = {"tp8": (8, False), "tp8_ep8": (8, True)}


def checkpoint_shapes(model: str, layers: int | None = None, shrink: bool = False) -> Checkpoint:
    """The checkpoint's tensor names, shapes and dtypes, as transformers saves the model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    cfg = _config(model, layers, shrink)
    cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    saved = revert_weight_conversion(hf, hf.state_dict())
    return {n: (tuple(t.shape), t.dtype) for n, t in saved.items()}


def _config(model: str, layers: int | None, shrink: bool = False) -> dict[str, Any]:
    """The published config (`shrink`: the same counts at tiny widths), optionally cut to `layers`."""
    cfg = shrunk(MODELS[model], vocab=512) if shrink else dict(MODELS[model])
    cfg.pop("quantization_config", None)  # bf16 weights: the fp8 receiver is another issue's
    cfg.setdefault("max_position_embeddings", 4096)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


class _Group:
    """What vLLM's model construction asks a parallel group: its size and this rank's place in it."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank_in_group, self.rank, self.local_rank = world_size, rank, rank, rank
        self.ranks = list(range(world_size))
        self.is_first_rank, self.is_last_rank = rank == 0, rank == world_size - 1
        self.device_group = self.cpu_group = self
        self.unique_name = f"scale:{world_size}:{rank}"

    def size(self) -> int:
        return self.world_size

    def __getattr__(self, name: str) -> Any:  # any collective: the harness never communicates
        raise AttributeError(f"the scale harness's stand-in group has no {name!r}")


@contextlib.contextmanager
def fake_parallel(tp: int, rank: int, ep: bool) -> Iterator[None]:
    """vLLM's parallel groups as rank `rank` of TP=`tp` (EP over the same ranks when `ep`)."""
    import vllm.distributed.parallel_state as ps

    names = ("_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP")
    saved = {n: getattr(ps, n) for n in names}
    groups = {"_TP": _Group(tp, rank), "_EP": _Group(tp, rank) if ep else _Group(1, 0)}
    for n in names:
        setattr(ps, n, groups.get(n) or _Group(1, 0))
    try:
        yield
    finally:
        for n, g in saved.items():
            setattr(ps, n, g)


def engine_config(model: str, tp: int, ep: bool, layers: int | None = None, shrink: bool = False):
    """vLLM's config for the model as `vllm serve` would make it (no weights, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    d = Path(tempfile.mkdtemp(prefix="scale_"))
    (d / "config.json").write_text(json.dumps(_config(model, layers, shrink)))
    config = EngineArgs(model=str(d), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                        max_model_len=4096, enable_expert_parallel=ep, load_format="dummy").create_engine_config()
    config.parallel_config.tensor_parallel_size = tp
    return config


def meta_model(config, tp: int, rank: int, ep: bool, device: str = "meta") -> torch.nn.Module:
    """vLLM's model class on `device` (full shape: `meta`), as rank `rank` builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    config.compilation_config.static_forward_context.clear()  # each rank's model registers its layers anew
    default = torch.get_default_dtype()
    with fake_parallel(tp, rank, ep), set_current_vllm_config(config), torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return initialize_model(vllm_config=config)
        finally:
            torch.set_default_dtype(default)


def probe_rank(config, checkpoint: Checkpoint, tp: int, rank: int, ep: bool) -> dict[str, Any]:
    """One rank's startup probe: its placements and its `delta_coverage` reply."""
    from vllm.config import set_current_vllm_config

    start = time.perf_counter()
    model = meta_model(config, tp, rank, ep)
    built = time.perf_counter()
    with fake_parallel(tp, rank, ep), set_current_vllm_config(config):
        placements = build_placement(model.load_weights, storages_of(model.named_parameters()), checkpoint)
    done = time.perf_counter()
    reply = {"rank": rank, "coverage": coverage(placements),
             "unread": [n for n, p in placements.items() if not p.read],
             "fallback": [n for n, p in placements.items() if p.fallback_reason]}
    return {"placements": placements, "reply": reply, "build_s": built - start, "probe_s": done - built}


def full_shape_startup(model: str, layout: str, rank: int, layers: int | None = None) -> dict[str, Any]:
    """The startup path at full shape for `rank`: probe (every rank), coverage check, ownership."""
    tp, ep = LAYOUTS[layout]
    rank = rank % tp
    checkpoint = checkpoint_shapes(model, layers)
    config = engine_config(model, tp, ep, layers)
    others = [probe_rank(config, checkpoint, tp, r, ep)["reply"] for r in range(tp) if r != rank]
    with PeakRss() as peak:
        start = time.perf_counter()
        mine = probe_rank(config, checkpoint, tp, rank, ep)
        replies = sorted([*others, mine["reply"]], key=lambda r: r["rank"])
        checked = time.perf_counter()
        report = check_coverage(replies, {n: s for n, (s, _) in checkpoint.items()})
        coverage_s = time.perf_counter() - checked
        owned = time.perf_counter()
        ownership = Ownership.from_coverages([r["coverage"] for r in replies], rank)
        ownership_s = time.perf_counter() - owned
        total = time.perf_counter() - start
    placements = mine["placements"]
    return {
        "model": model, "layout": layout, "rank": rank, "tp": tp, "ep": ep,
        "checkpoint_tensors": len(checkpoint),
        "destination_params": len({s.target for p in placements.values() for s in p.segments}),
        "segments": sum(len(p.segments) for p in placements.values()),
        "held_tensors": sum(1 for p in placements.values() if p.segments),
        "fallback": len(mine["reply"]["fallback"]), "coverage_ok": report["ok"],
        "coverage_errors": dict(list(report["errors"].items())[:3]), "ignored": len(report["ignored"]),
        "masked_tensors": len(ownership.masked), "uncounted_tensors": len(ownership.uncounted),
        "build_s": mine["build_s"], "probe_s": mine["probe_s"], "coverage_s": coverage_s,
        "ownership_s": ownership_s, "startup_s_full_shape": total, "startup_peak_bytes_full_shape": peak.extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["glm-4.7-355b-a32b", "qwen3-235b-a22b"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--rank", type=int, default=-1, help="the rank reported (default: the last)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {}
    for model in a.models:
        for layout in a.layouts:
            r = full_shape_startup(model, layout, a.rank)
            results[f"{model}/{layout}"] = r
            print(json.dumps(r), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"full_shape": results}, indent=1))


if __name__ == "__main__":
    main()
