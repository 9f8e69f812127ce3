"""DP engines of a MoE model, shaped as vLLM 0.32 lays one out, as in-process workers behind one client.

Why: vLLM keeps `data_parallel_size > 1` inside the engine only for MoE models (`DPEngineCoreProc`,
v1/engine/core.py `run_engine_core`) and splits their experts across the DP engines, while attention
and the dense weights are replicated on every engine. vLLM 0.32's CPU build cannot run such an
engine's forward (`all_gatherv` raises NotImplementedError), so these ranks are the synthetic model
with its experts loaded by vLLM's own code: `FusedMoEParallelConfig.make` decides each rank's
EP / TP rank across DP, `ExpertMapManager` its expert map, and `RoutedExperts.weight_loader` the
copies; the receiver learns the placement from those loaders, as on a real engine.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import requests
import torch

from harness.engine_pool import API_KEY
from harness.synthetic import InProcessEngine, LocalWorker, device_check

SHARD_IDS = {"gate": "w1", "up": "w3", "down": "w2"}


def moe_parallel(tp: int, dp: int, dp_rank: int, tp_rank: int, ep: bool) -> Any:
    """vLLM's `FusedMoEParallelConfig.make` for one rank of a DP x TP engine set (its groups' ranks given)."""
    from vllm.model_executor.layers.fused_moe import config

    parallel = SimpleNamespace(
        enable_expert_parallel=ep, all2all_backend="allgather_reducescatter", enable_eplb=False
    )
    with (
        mock.patch.object(config, "get_dp_group", lambda: SimpleNamespace(rank_in_group=dp_rank)),
        mock.patch.object(config, "get_tensor_model_parallel_rank", lambda: tp_rank),
    ):
        return config.FusedMoEParallelConfig.make(
            tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=1, vllm_parallel_config=parallel
        )


def routed_experts(moe: Any, experts: int) -> Any:
    """vLLM's `RoutedExperts` carrying only what its `weight_loader` reads for unquantized bf16 experts."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    host = torch.nn.Module.__new__(RoutedExperts)
    torch.nn.Module.__init__(host)
    host.quant_config = None
    host.quant_method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    host._fused_shared_expert_quantizer = None
    host._loaded_expert_biases = set()
    host.expert_map_manager = ExpertMapManager(
        max_num_batched_tokens=16,
        top_k=2,
        global_num_experts=experts,
        num_redundant_experts=0,
        num_expert_group=None,
        moe_parallel_config=moe,
        placement_strategy="linear",
        enable_eplb=False,
    )
    host.moe_config = SimpleNamespace(
        is_act_and_mul=True,
        moe_parallel_config=moe,
        tp_rank=moe.tp_rank,
        tp_size=moe.tp_size,
        tp_shard_with_padding=False,
        num_logical_experts=experts,
    )
    return host


def moe_dp_rank(cfg: Any, *, tp: int, dp: int, dp_rank: int, tp_rank: int, ep: bool) -> torch.nn.Module:
    """One rank of DP engine `dp_rank`: attention and dense MLPs TP-split within the engine (replicated
    across DP), experts placed by vLLM across the DP x TP world."""
    dc = device_check()
    model = dc.SyntheticLM(cfg, rank=tp_rank, tp=tp)
    moe = moe_parallel(tp, dp, dp_rank, tp_rank, ep)
    host = routed_experts(moe, cfg.experts)
    local = host.expert_map_manager.local_num_experts
    inter = cfg.moe_inter // moe.tp_size
    model.moe = SimpleNamespace(config=moe, expert_map=host.expert_map_manager.expert_map)
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for name, shape in (
            ("w13_weight", (local, 2 * inter, cfg.hidden)),
            ("w2_weight", (local, cfg.hidden, inter)),
        ):
            param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
            param.weight_loader = _vllm_loader(host, name)
            setattr(experts, name, param)
    return model


def _vllm_loader(host: Any, name: str):
    """The synthetic model's (param, weight, (expert, proj)) call as vLLM's expert loader call."""

    def load(param: torch.Tensor, weight: torch.Tensor, shard: tuple[int, str]) -> None:
        expert, proj = shard
        host.weight_loader(param, weight, f"experts.{name}", SHARD_IDS[proj], expert)

    return load


def moe_dp_engines(
    model_dir: Path, base: dict[str, torch.Tensor], *, tp: int, dp: int, ep: bool
) -> tuple[list[list[torch.nn.Module]], list[InProcessEngine]]:
    """`dp` engines of `tp` ranks each on `base`; each worker configured as vLLM configures a MoE DP
    engine (`data_parallel_size` kept, `data_parallel_rank` = `data_parallel_index` = its DP rank)."""
    from safetensors.torch import save_file

    cfg = device_check().SIZES["tiny"]
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in base.items()}, str(model_dir / "model.safetensors"))
    models, engines = [], []
    for d in range(dp):
        ranks = [moe_dp_rank(cfg, tp=tp, dp=dp, dp_rank=d, tp_rank=r, ep=ep) for r in range(tp)]
        workers = []
        for r, m in enumerate(ranks):
            m.load_weights(base.items())
            w = LocalWorker(m, model_dir, r)
            w.vllm_config.parallel_config = SimpleNamespace(
                data_parallel_size=dp, data_parallel_rank=d, data_parallel_index=d
            )
            workers.append(w)
        models.append(ranks)
        engines.append(InProcessEngine(workers))
    return models, engines


class DPLBEngine:
    """What `DeltaUpdater` reaches under `--data-parallel-size N`: vLLM's `DPLBAsyncMPClient` behind
    `AsyncLLM`. `collective_rpc` and pause/resume reach every engine but answer with the first one's
    replies (`call_utility_async`); `engine_core.call_utility_all_async` answers per engine, in rank order."""

    def __init__(self, replicas: list[InProcessEngine]) -> None:
        self.replicas = replicas
        self.engine_core = SimpleNamespace(
            engine_ranks_managed=list(range(len(replicas))), call_utility_all_async=self._call_all
        )

    async def _call_all(
        self, utility: str, method: str, timeout: Any, args: tuple, kwargs: Any
    ) -> list[list]:
        assert utility == "collective_rpc" and timeout is None and kwargs is None
        return [await r.collective_rpc(method, args=args) for r in self.replicas]

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return (await self._call_all("collective_rpc", method, None, args, None))[0]

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        for r in self.replicas:
            await r.pause_generation(mode, clear_cache)

    async def resume_generation(self) -> None:
        for r in self.replicas:
            await r.resume_generation()

    async def get_weight_version(self) -> None:
        return None

    @property
    def paused(self) -> list[bool]:
        return [r.paused for r in self.replicas]


def replica_checksums(url: str) -> dict[int, dict[str, str]]:
    """vLLM's own `/weight_checker` digests, per DP index (its keys are `dp<i>:pp0:pcp0:tp0:<name>`)."""
    r = requests.post(
        f"{url}/weight_checker",
        json={"action": "checksum"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    r.raise_for_status()
    out: dict[int, dict[str, str]] = {}
    for key, digest in r.json()["checksums"].items():
        dp, _pp, _pcp, _tp, name = key.split(":", 4)
        out.setdefault(int(dp.removeprefix("dp")), {})[name] = digest
    return out


def unprefixed(checksums: dict[str, str]) -> dict[str, str]:
    return {key.split(":", 4)[4]: digest for key, digest in checksums.items()}
