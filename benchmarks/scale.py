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

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from benchmarks.scale_configs import MODELS, shrunk  # noqa: E402
from vllm_delta.engine.digests import Ownership, check_coverage, coverage  # noqa: E402
from vllm_delta.engine.intercept import storages_of  # noqa: E402
from vllm_delta.engine.probe import PeakRss, build_placement  # noqa: E402

Checkpoint = dict[str, tuple[tuple[int, ...], torch.dtype]]
LAYOUTS = {"tp8": (8, False), "tp8_ep8": (8, True)}


def checkpoint_shapes(
    model: str, layers: int | None = None, shrink: bool = False, experts: int | None = None
) -> Checkpoint:
    """The checkpoint's tensor names, shapes and dtypes, as transformers saves the model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    cfg = _config(model, layers, shrink, experts)
    cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    saved = revert_weight_conversion(hf, hf.state_dict())
    return {n: (tuple(t.shape), t.dtype) for n, t in saved.items()}


def _config(
    model: str, layers: int | None, shrink: bool = False, experts: int | None = None
) -> dict[str, Any]:
    """The published config (`shrink`: the same counts at tiny widths), optionally cut to `layers`
    (and to `experts` routed experts a layer: the cost model varies the tensor count alone)."""
    cfg = shrunk(MODELS[model], vocab=512) if shrink else dict(MODELS[model])
    cfg.pop("quantization_config", None)  # bf16 weights: the fp8 receiver is another issue's
    cfg.setdefault("max_position_embeddings", 4096)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if experts is not None:
        cfg["n_routed_experts"] = experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
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


def engine_config(
    model: str, tp: int, ep: bool, layers: int | None = None, shrink: bool = False, experts: int | None = None
):
    """vLLM's config for the model as `vllm serve` would make it (no weights, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    d = Path(tempfile.mkdtemp(prefix="scale_"))
    (d / "config.json").write_text(json.dumps(_config(model, layers, shrink, experts)))
    config = EngineArgs(
        model=str(d),
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=4096,
        enable_expert_parallel=ep,
        load_format="dummy",
    ).create_engine_config()
    config.parallel_config.tensor_parallel_size = tp
    return config


def meta_model(config, tp: int, rank: int, ep: bool, device: str = "meta") -> torch.nn.Module:
    """vLLM's model class on `device` (full shape: `meta`), as rank `rank` builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import expert_map_manager
    from vllm.model_executor.model_loader.utils import initialize_model

    config.compilation_config.static_forward_context.clear()  # each rank's model registers its layers anew
    default = torch.get_default_dtype()
    manager = expert_map_manager.ExpertMapManager.__init__

    def on_cpu(self, *args, **kwargs):  # EP's expert map is routing metadata with values, not a weight
        with torch.device("cpu"):
            manager(self, *args, **kwargs)

    expert_map_manager.ExpertMapManager.__init__ = on_cpu
    with fake_parallel(tp, rank, ep), set_current_vllm_config(config), torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return initialize_model(vllm_config=config)
        finally:
            torch.set_default_dtype(default)
            expert_map_manager.ExpertMapManager.__init__ = manager


def probe_rank(config, checkpoint: Checkpoint, tp: int, rank: int, ep: bool) -> dict[str, Any]:
    """One rank's startup probe: its placements and its `delta_coverage` reply."""
    from vllm.config import set_current_vllm_config

    start = time.perf_counter()
    model = meta_model(config, tp, rank, ep)
    built = time.perf_counter()
    with fake_parallel(tp, rank, ep), set_current_vllm_config(config):
        placements = build_placement(model.load_weights, storages_of(model.named_parameters()), checkpoint)
    done = time.perf_counter()
    reply = {
        "rank": rank,
        "coverage": coverage(placements),
        "unread": [n for n, p in placements.items() if not p.read],
        "fallback": [n for n, p in placements.items() if p.fallback_reason],
    }
    return {"placements": placements, "reply": reply, "build_s": built - start, "probe_s": done - built}


def full_shape_startup(model: str, layout: str, rank: int, layers: int | None = None) -> dict[str, Any]:
    """The startup path at full shape for `rank`: probe (every rank), coverage check, ownership."""
    tp, ep = LAYOUTS[layout]
    rank = rank % tp
    checkpoint = checkpoint_shapes(model, layers)
    config = engine_config(model, tp, ep, layers)
    # The chosen rank first, so its peak is not hidden in memory the other ranks' probes freed; then
    # the others (they run in parallel on a node), then the check and analysis on all replies.
    with PeakRss() as probe_peak:
        start = time.perf_counter()
        mine = probe_rank(config, checkpoint, tp, rank, ep)
        probed = time.perf_counter() - start
    others = [probe_rank(config, checkpoint, tp, r, ep)["reply"] for r in range(tp) if r != rank]
    with PeakRss() as check_peak:
        replies = sorted([*others, mine["reply"]], key=lambda r: r["rank"])
        checked = time.perf_counter()
        report = check_coverage(replies, {n: s for n, (s, _) in checkpoint.items()})
        coverage_s = time.perf_counter() - checked
        owned = time.perf_counter()
        ownership = Ownership.from_coverages([r["coverage"] for r in replies], rank)
        ownership_s = time.perf_counter() - owned
    total = probed + coverage_s + ownership_s
    peak = (
        None if probe_peak.extra is None or check_peak.extra is None else probe_peak.extra + check_peak.extra
    )
    placements = mine["placements"]
    return {
        "model": model,
        "layout": layout,
        "rank": rank,
        "tp": tp,
        "ep": ep,
        "checkpoint_tensors": len(checkpoint),
        "destination_params": len({s.target for p in placements.values() for s in p.segments}),
        "segments": sum(len(p.segments) for p in placements.values()),
        "held_tensors": sum(1 for p in placements.values() if p.segments),
        "fallback": len(mine["reply"]["fallback"]),
        "coverage_ok": report["ok"],
        "coverage_errors": dict(list(report["errors"].items())[:3]),
        "ignored": len(report["ignored"]),
        "masked_tensors": sum(v == "some" for v in ownership.shares.values()),
        "uncounted_tensors": sum(v == "none" for v in ownership.shares.values()),
        "build_s": mine["build_s"],
        "probe_s": mine["probe_s"],
        "coverage_s": coverage_s,
        "ownership_s": ownership_s,
        "startup_s_full_shape": total,
        "startup_peak_bytes_full_shape": peak,  # probe's peak + the check's peak over what was resident: an upper bound
    }


def count_true_checkpoint(model: str, out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """The model's layer, expert and head counts at tiny widths: a checkpoint a CPU engine loads."""
    from harness.tiny_models import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _config(model, layers, shrink=True)
    cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(
                torch.randn_like(param) * (0.01 if name.endswith("e_score_correction_bias") else 0.05)
            )
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    train_tokenizer(out)
    return out


def write_deltas(base: Path, root: Path, densities: tuple[float, ...]) -> dict[str, torch.Tensor]:
    """`root/v1`, `root/v2`, ...: one `ulp_zstd` delta per density, each on the last, written by the sender's
    wire writer fed the bitwise changes (`vllm-delta diff` pays ~20 ms a tensor here); the final weights."""
    from harness.perturb import perturb_tensor
    from safetensors.torch import load_file

    from vllm_delta.wire import DeltaWriter, tensor_digest

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(base.glob("*.safetensors")):
        weights.update(load_file(shard))
    gen = torch.Generator().manual_seed(1)
    for v, density in enumerate(densities, start=1):
        with DeltaWriter(root / f"v{v}", version=v, base_version=v - 1, encoding="ulp_zstd") as writer:
            for name, old in weights.items():
                new = perturb_tensor(old, density, gen)
                a, b = old.reshape(-1), new.reshape(-1)
                size = a.element_size()
                pos = torch.nonzero(
                    a.view(torch.uint8).view(-1, size).ne(b.view(torch.uint8).view(-1, size)).any(1)
                ).squeeze(1)
                writer.add(name, pos, b[pos], a[pos], shape=tuple(old.shape), post_hash=tensor_digest(new))
                weights[name] = new
    return weights


def count_true_engine(
    model: str,
    work: Path,
    layers: int | None = None,
    lock: bool = False,
    densities: tuple[float, ...] = (0.005, 0.02),
) -> dict[str, Any]:
    """`vllm serve --enable-delta-updates` on the count-true checkpoint: startup to ready, then a delta
    at each density in turn (0.5 % and 2 %, perturbed like the suite's, diffed by `vllm-delta diff`),
    bit-exact at the end against vLLM's own fresh load of the final checkpoint. `lock`: take
    /tmp/engine.lock for the engine part only (not when the caller already runs under `flock
    /tmp/engine.lock`: that would wait forever)."""
    from harness.fresh_load import save_checkpoint

    key = "scale-bench-key"
    headers = {"Authorization": f"Bearer {key}"}
    base = count_true_checkpoint(model, work / "base", layers)
    root = work / "root"
    root.mkdir(parents=True, exist_ok=True)
    weights = write_deltas(base, root, densities)
    versions = list(enumerate(densities, start=1))
    current = save_checkpoint(weights, like=base, out=work / "final")
    with _engine_lock() if lock else contextlib.nullcontext():
        return _serve_and_sync(model, layers, base, current, root, versions, work, key, headers)


@contextlib.contextmanager
def _engine_lock(path: str = "/tmp/engine.lock") -> Iterator[None]:
    """The machine's one-engine-at-a-time lock, held for the engine run only (not the checkpoint build)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _serve_and_sync(
    model: str,
    layers: int | None,
    base: Path,
    current: Path,
    root: Path,
    versions: list[tuple[int, float]],
    work: Path,
    key: str,
    headers: dict[str, str],
) -> dict[str, Any]:
    import requests
    from harness.fresh_load import FreshLoader
    from harness.vllm_engine import VllmServer

    start = time.perf_counter()
    with VllmServer(
        base,
        work / "serve.log",
        extra_args=["--enable-delta-updates", "--delta-updates-root", str(root), "--api-key", key],
        startup_timeout_s=1800,
    ) as server:
        healthy = time.perf_counter() - start
        while True:
            st = requests.get(f"{server.url}/delta_updates/status", headers=headers, timeout=60).json()
            if st["placement"]["ready"] and st["placement"].get("coverage"):
                break
            time.sleep(0.5)
        ready = time.perf_counter() - start
        out: dict[str, Any] = {
            "checkpoint_tensors": len(checkpoint_shapes(model, layers)),
            "healthy_s": healthy,
            "engine_ready_s": ready,
            "probe_s": st["placement"]["probe_s"],
            "coverage_ok": st["placement"]["coverage"]["ok"],
        }
        for v, density in versions:
            r = requests.post(
                f"{server.url}/update_weights_delta",
                headers=headers,
                timeout=3600,
                json={"path": f"v{v}", "version": v, "base_version": v - 1},
            )
            r.raise_for_status()
            body = r.json()
            tag = {0.005: "0p5pct", 0.02: "2pct"}[density]
            out[f"prepare_s_{tag}"] = body["prepare_s"]
            out[f"commit_s_{tag}"] = body["apply_s"]
            out[f"pause_s_{tag}"] = body.get("pause_s")
            out[f"changed_{tag}"] = body["changed"]
        served = requests.post(
            f"{server.url}/weight_checker", json={"action": "checksum"}, headers=headers, timeout=600
        ).json()["checksums"]
    loader = FreshLoader()
    try:
        fresh = loader.checksums(current)
    finally:
        loader.close()
    out["bitexact_vs_fresh_load"] = served == fresh
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--rank", type=int, default=-1, help="the rank reported (default: the last)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--engine", action="store_true", help="also the tensor-count-true GLM-4.7 engine")
    ap.add_argument("--engine-layers", type=int, default=None, help="cut the engine's model to N layers")
    ap.add_argument("--lock", action="store_true", help="take /tmp/engine.lock for the engine run only")
    ap.add_argument("--skip-full-shape", action="store_true")
    ap.add_argument(
        "--cost-model",
        action="store_true",
        help="also the fitted per-unit costs and the node projection (benchmarks/cost_model.py)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (pin with taskset too)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results, engine_run = {}, None
    if a.engine:
        with tempfile.TemporaryDirectory(prefix="scale_engine_") as work:
            engine_run = count_true_engine("glm-4.7-355b-a32b", Path(work), a.engine_layers, a.lock)
        print(json.dumps(engine_run), flush=True)
    model_fit = None
    if a.cost_model:
        from benchmarks.cost_model import cost_model

        model_fit = cost_model([6, 14], [40, 160], (0.005, 0.02, 0.1), repeats=3, count_true=True)
        print(json.dumps({k: v for k, v in model_fit.items() if k != "rows"}), flush=True)
    for model in [] if a.skip_full_shape else a.models:
        for layout in a.layouts:
            r = full_shape_startup(model, layout, a.rank)
            results[f"{model}/{layout}"] = r
            print(json.dumps(r), flush=True)
    if a.json:
        # What this run did not measure stays null, not guessed.
        engine = {
            k: None
            for k in (
                "engine_ready_s",
                "prepare_s_0p5pct",
                "prepare_s_2pct",
                "commit_s_2pct",
                "ops_per_sync_2pct",
                "per_tensor_us",
                "per_change_ns",
                "projected_node_sync_s_2pct",
            )
        }
        engine.update({k: v for k, v in (engine_run or {}).items() if k in engine})
        engine.update({k: v for k, v in (model_fit or {}).items() if k in engine})
        a.json.write_text(
            json.dumps(
                {
                    "startup_s_full_shape": {k: r["startup_s_full_shape"] for k, r in results.items()},
                    "startup_peak_bytes_full_shape": {
                        k: r["startup_peak_bytes_full_shape"] for k, r in results.items()
                    },
                    "startup_probe_per_tensor_us": {
                        k: r["probe_s"] / r["checkpoint_tensors"] * 1e6 for k, r in results.items()
                    },
                    **engine,
                    "engine": engine_run,
                    "cost_model": model_fit,
                    "full_shape": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
