"""`WeightTransferTrainerFactory.trainer_init` with `DeltaTrainerInitInfo`: what it refuses before any
engine is contacted (the engine tests cover the rest)."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)

from vllm_delta import DeltaTrainerInitInfo


class HalfSource(WeightSource):
    """A source that holds one of two tensors (a pipeline stage)."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta("a", torch.bfloat16, (2,)), ParamMeta("b", torch.bfloat16, (2,))]

    def __iter__(self):
        yield "a", torch.zeros(2, dtype=torch.bfloat16)
        yield "b", None

    def held_names(self) -> set[str]:
        return {"a"}


class NoEngine:
    """Any call means the refusal came too late."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine was contacted ({name})")


def test_registered_and_dispatched_by_init_info():
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as Factory

    assert DeltaTrainerInitInfo.backend == "vllm_delta" and "vllm_delta" in Factory._registry
    with pytest.raises(TypeError):
        DeltaTrainerInitInfo("/tmp")  # `rank` is keyword-only and required, as for every vLLM backend


@pytest.mark.parametrize(
    "info, source, match",
    [
        (dict(delta_dir=None), lambda: ModuleSource(torch.nn.Linear(2, 2)), "needs delta_dir"),
        (dict(delta_dir="/tmp"), lambda: None, "pass source="),
        (dict(delta_dir="/tmp"), HalfSource, "pass group="),
    ],
)
def test_refused_before_any_engine_call(info, source, match):
    with pytest.raises(ValueError, match=match):
        WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(**info, rank=0), client=NoEngine(), source=source()
        )
