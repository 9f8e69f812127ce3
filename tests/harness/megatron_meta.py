"""One rank of a large Megatron job, built for real by mbridge + megatron-core with every weight on `meta`.

Why: registration at 355B must be measured at the real shapes and layout (64 ranks, TP x PP x EP),
which no CPU can hold or spawn. torch's `fake` process-group backend lets this one process be rank
`rank` of a `world`-rank job: megatron's `parallel_state` builds every group (collectives are
no-ops), mbridge builds that rank's exact model chunk (names, shapes, `tensor_model_parallel` /
`partition_dim`), and `meta` tensors hold no memory. Only what megatron-core hard-codes as CUDA is
redirected while building (device -> meta), and everything is put back on exit, so tests may use
it in-process. Not for anything that reads weight values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def hf_config(fields: dict[str, Any]):
    """A transformers config from published `config.json` fields (benchmarks/scale_configs.py)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if k not in ("architectures", "quantization_config")}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not hasattr(cfg, "rope_theta"):
        cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return cfg


@contextmanager
def meta_rank(fields: dict[str, Any], *, world: int, rank: int, tp: int = 1, pp: int = 1, ep: int = 1,
              etp: int = 1, make_vocab_size_divisible_by: int | None = None,
              extra_args: dict[str, Any] | None = None) -> Iterator[tuple[Any, Any]]:
    """(gpt, bridge) of rank `rank` in a `world`-rank job, weights on `meta`; torn down on exit.
    `extra_args` go to mbridge's `set_extra_args` (e.g. uneven pipeline stages)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from mbridge import AutoBridge
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = hf_config(fields)
    saved = (torch.cuda.current_device, torch.cuda.Stream, torch.nn.Module.cuda)
    # megatron-core asks for `torch.cuda.current_device()` (router, DDP buffers), builds a side stream
    # in the alltoall dispatcher, and mbridge calls `.cuda()`: all to meta / no-ops while building.
    torch.cuda.current_device = lambda: torch.device("meta")
    torch.cuda.Stream = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                     create_gloo_process_groups=False)
        bridge = AutoBridge.from_config(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        bridge.set_extra_args(moe_grouped_gemm=False, persist_layer_norm=False, sequence_parallel=False,
                              use_cpu_initialization=True, gradient_accumulation_fusion=False,
                              masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                              **(extra_args or {}))
        bridge._get_transformer_layer_spec = lambda vp_stage=None: get_gpt_decoder_block_spec(
            bridge.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
        with torch.device("meta"):
            (f16,) = bridge.get_model(wrap_with_ddp=False, use_cpu_initialization=True)
        yield f16.module, bridge
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        torch.cuda.current_device, torch.cuda.Stream, torch.nn.Module.cuda = saved
