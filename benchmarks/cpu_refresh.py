"""Where a "rerun" unit's re-run (`derived.Unit.rederive`) spends its time on vLLM's real CPU linear layers (the oneDNN repack).

Builds the 0.5 B Llama's 112 linear layers of benchmarks/apply.py (28 layers x qkv [2048, 1024],
o [1024, 1024], gate_up [8192, 1024], down [1024, 4096], bf16) as vLLM unquantized linear layers,
runs vLLM's post-load step under our observation (as an engine with delta updates on does), then
times, per kind and for all 112, in rounds whose order alternates:

- refresh: `derived.Unit.rederive`, what a commit runs for every touched module;
- step: vLLM's step alone (`dispatch_cpu_unquantized_gemm`) with the weight put back, the floor
  of any refresh that re-runs vLLM's step;
- create: `create_onednn_mm` alone on the canonical tensor (the oneDNN reorder into its packed
  copy), each replacing the module's previous handler as the step does;
- prebuild: `derived.prebuild` from a copy of each weight, what a prepare now runs for every
  touched linear (while the engine serves);
- swap: `stand_in.Built.install` of those handlers, what the commit now runs in their place;
- memcpy: `copy_` of the same bytes into preallocated tensors, the floor of any full repack;
- clone: what the generic path's `canon.clone()` would cost if it ran for these layers.

    taskset -c 1 .venv/bin/python benchmarks/cpu_refresh.py [--threads 1] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

SHAPES = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (8192, 1024), "down": (1024, 4096)}


def build(layers: int) -> tuple[nn.Module, dict[str, list[nn.Module]]]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_delta.engine import transforms

    model = nn.ModuleDict()
    for i in range(layers):
        for kind, shape in SHAPES.items():
            m = nn.Module()
            m.weight = nn.Parameter(torch.randn(shape).to(torch.bfloat16), requires_grad=False)
            m.quant_method = UnquantizedLinearMethod()
            model[f"{i}_{kind}"] = m
    with transforms.observing(model):
        for m in model.values():
            m.quant_method.process_weights_after_loading(m)
    return model, {kind: [m for name, m in model.items() if name.endswith(f"_{kind}")] for kind in SHAPES}


def variants(model: nn.Module, mods: list[nn.Module]) -> dict[str, Callable[[], object]]:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from vllm_delta.engine import derived, transforms

    outs = [torch.empty_like(m.weight) for m in mods]

    def step() -> None:
        for m in mods:
            w = m._parameters["weight"]
            dispatch_cpu_unquantized_gemm(m, remove_weight=True)
            m._parameters["weight"] = w

    def create() -> None:
        for m in mods:
            handler = ops.create_onednn_mm(m.weight.t(), 32)
            m.cpu_linear = lambda x, weight, bias, h=handler: ops.onednn_mm(h, x, bias)

    made: list = []  # derived.prebuild's stand_in.Built per module

    def prebuild() -> None:
        units = [transforms.rerun_unit(m) for m in mods]
        made[:] = [derived.prebuild(model, u, {f"{u.name}.weight": u.module.weight.clone()}) for u in units]

    def swap() -> None:
        for built in made:
            built.install()

    return {
        "refresh": lambda: [transforms.rerun_unit(m).rederive() for m in mods],
        "prebuild": prebuild,
        "swap": swap,
        "step": step,
        "create": create,
        "memcpy": lambda: [o.copy_(m.weight) for o, m in zip(outs, mods)],
        "clone": lambda: [m.weight.clone() for m in mods],
    }


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, by_kind = build(a.layers)
    groups = {**by_kind, "all": [m for ms in by_kind.values() for m in ms]}
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {g: {} for g in groups}
    for r in range(a.rounds):
        for group, mods in groups.items():
            vs = list(variants(model, mods).items())
            for name, fn in vs if r % 2 == 0 else vs[::-1]:
                fn()  # warm: the first call after another group's allocates, later ones reuse
                samples[group].setdefault(name, []).append(timed(fn))
    out = {
        "threads": a.threads,
        "rounds": a.rounds,
        "modules": {g: len(m) for g, m in groups.items()},
        "ms": {},
    }
    for group, by_name in samples.items():
        row = {
            name: {
                "cpu": statistics.median(c for c, _ in xs) * 1e3,
                "wall": statistics.median(w for _, w in xs) * 1e3,
            }
            for name, xs in by_name.items()
        }
        out["ms"][group] = row
        print(
            f"{group:8s} x{len(groups[group]):3d} "
            + "  ".join(f"{n} {v['cpu']:7.1f}/{v['wall']:7.1f}" for n, v in row.items())
            + "  (ms cpu/wall)",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
