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

from harness.megatron_cpu import meta_chunk


def hf_config(fields: dict[str, Any]):
    """A transformers config from published `config.json` fields (benchmarks/scale_configs.py)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if k not in ("architectures", "quantization_config")}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not hasattr(cfg, "rope_theta"):
        cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return cfg


@contextmanager
def meta_rank(
    fields: dict[str, Any],
    *,
    world: int,
    rank: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    make_vocab_size_divisible_by: int | None = None,
    extra_args: dict[str, Any] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """(gpt, bridge) of rank `rank` in a `world`-rank job of published config `fields`, weights on
    `meta`; torn down on exit. `extra_args` go to mbridge's `set_extra_args` (e.g. uneven stages)."""
    with meta_chunk(
        hf_config(fields),
        world=world,
        rank=rank,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        extra_args=extra_args,
    ) as built:
        yield built
