"""TP ranks of the device check's synthetic vLLM-shaped model, as in-process workers and an engine.

Why: the receiver's multi-rank logic (counted-once digests, the route's checks, commit faults)
runs here in one process, in seconds, on the same worker extension and routes vLLM loads. The
model itself lives in benchmarks/device_check.py so the GPU check and these tests share it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_delta.engine.worker import DeltaWorkerExtension

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.py"


def device_check():
    """benchmarks/device_check.py as a module (it is a script, not a package member)."""
    if "device_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("device_check", _PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["device_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["device_check"]


class LocalWorker(DeltaWorkerExtension):
    """The worker extension on a plain module, as vLLM's worker would carry it."""

    def __init__(self, model: torch.nn.Module, model_dir: Path, rank: int) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir)))
        self.rank = rank


class InProcessEngine:
    """What `DeltaUpdater` calls on vLLM's engine client, answered by in-process workers."""

    def __init__(self, workers: list[LocalWorker]) -> None:
        self.workers = workers
        self.paused = False

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def get_weight_version(self) -> None:
        return None


def tp_ranks(
    model_dir: Path, base: dict[str, torch.Tensor], tp: int = 2, ep: bool = False, device: str = "cpu"
) -> tuple[list[torch.nn.Module], list[LocalWorker]]:
    """`tp` ranks of the tiny synthetic model loaded with `base` (also saved as the served checkpoint)."""
    dc = device_check()
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().cpu() for n, t in base.items()}, str(model_dir / "model.safetensors"))
    models = [dc.SyntheticLM(dc.SIZES["tiny"], rank=r, tp=tp, ep=ep, device=device) for r in range(tp)]
    for m in models:
        if device != "meta":
            m.load_weights(base.items())
    return models, [LocalWorker(m, model_dir, r) for r, m in enumerate(models)]


def loaded(checkpoint: dict[str, torch.Tensor], rank: int, tp: int, ep: bool = False) -> torch.nn.Module:
    """A fresh rank with `checkpoint` loaded directly: the reference an apply must equal."""
    dc = device_check()
    m = dc.SyntheticLM(dc.SIZES["tiny"], rank=rank, tp=tp, ep=ep)
    m.load_weights(checkpoint.items())
    return m


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of parameters whose bits differ."""
    got = dict(b.named_parameters())
    return [
        n for n, p in a.named_parameters() if not torch.equal(p.view(torch.uint8), got[n].view(torch.uint8))
    ]


def vllm_loop(model: torch.nn.Module) -> dict[str, str]:
    """Engine start's post-load loop: each quant method's step called the way vLLM's
    `process_weights_after_loading` does, under `transforms.observing`; {module: transform kind}."""
    from vllm_delta.engine.transforms import TRANSFORM_ATTR, observing

    with observing(model):
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
    return {
        n: t.kind for n, m in model.named_modules() if (t := getattr(m, TRANSFORM_ATTR, None)) is not None
    }
