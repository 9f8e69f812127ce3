"""Run by tests/weight_transfer/test_native_backend.py with the integrations venv (`make rl-venv`):
SkyRL 0.4.0's own `SkyrlWeightSyncClient` and `FsdpWeightSource`, unchanged, drive our trainer engine
through vLLM's trainer factory against a `vllm serve` with our backend; two syncs.

SkyRL 0.4.0 needs Python >= 3.12 to import as a package (its pydantic models use `typing.TypedDict`);
its two weight-sync modules used here import nothing of SkyRL at module scope and run on 3.11, so
they are loaded from the installed wheel by path. argv: engine URL, the engine's delta root, its
checkpoint dir, its version (the sender starts there), output file (the trainer's export).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from vllm_delta.integrations.skyrl import SkyrlDeltaInitInfo, register_trainer_engine


def skyrl_module(file: str):
    path = importlib.metadata.distribution("skyrl").locate_file(
        f"skyrl/backends/skyrl_train/weight_sync/{file}"
    )
    spec = importlib.util.spec_from_file_location(f"skyrl_{file[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    url, root, model_dir, version, out = sys.argv[1:6]
    assert importlib.metadata.version("skyrl") == "0.4.0"
    control, sources = skyrl_module("control_plane.py"), skyrl_module("sources.py")
    register_trainer_engine()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    client = control.SkyrlWeightSyncClient([url], 1)
    source = sources.FsdpWeightSource(model, torch.bfloat16)
    engine = WeightTransferTrainerFactory.trainer_init(
        SkyrlDeltaInitInfo(delta_dir=root, checkpoint=model_dir, version=int(version), rank=0),
        client=client,
        source=source,
    )
    metrics = []
    for step in (1, 2):
        gen = torch.Generator().manual_seed(10 + step)
        with torch.no_grad():
            for p in model.parameters():
                bits = p.view(-1).view(torch.int16)
                bits[torch.rand(bits.shape, generator=gen) < 0.02] += 1
        metrics.append(engine.send_weights())
    engine.shutdown()
    client.close()
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}, out)
    print(
        json.dumps(
            {"metrics": metrics, "skyrl_handles_prefix_cache_reset": engine.skyrl_handles_prefix_cache_reset}
        )
    )


if __name__ == "__main__":
    main()
