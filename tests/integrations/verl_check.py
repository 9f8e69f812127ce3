"""Run by test_verl.py in a child process with verl on its path (harness/rl_frameworks.py): our engine
through verl 0.9.1's own plugin loader, registry and base class, then two real syncs to a running engine.

argv: engine URL, the engine's delta root, its checkpoint dir, API key, its version (the sender starts
there: the root is shared), output file (the trainer's export of the weights it synced last, as
safetensors).
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs


async def sync(rank0, rank1, weights: dict, step: int, report: dict) -> dict:
    """One step as verl runs it: every actor rank's `send_weights`, the rollout side's `receive_weights`."""

    async def stream():  # verl hands over an (async) generator of full tensors
        for name, t in weights.items():
            yield name, t

    other = await rank1.send_weights(stream(), global_steps=step)
    assert other == {}, other
    report["received"] += [x async for x in rank0.receive_weights(global_steps=step)]
    return await rank0.send_weights(stream(), global_steps=step)


def main() -> None:
    url, root, model_dir, api_key, version, out = sys.argv[1:7]
    import_external_libs("vllm_delta.integrations.verl")  # what custom_backend_module does
    cls = CheckpointEngineRegistry.get("vllm_delta")
    assert issubclass(cls, CheckpointEngine) and cls.__module__ == "vllm_delta.integrations.verl"
    actor, rollout = cls.build_topology(2, 3, [{}] * 5)
    assert all(len(v) == 2 for v in actor.values()) and all(len(v) == 3 for v in rollout.values())
    kwargs = {
        "engines": [url],
        "delta_dir": root,
        "checkpoint": model_dir,
        "api_key": api_key,
        "version": int(version),
    }
    rank0 = CheckpointEngineRegistry.new("vllm_delta", bucket_size=1 << 20, **kwargs)
    rank1 = CheckpointEngineRegistry.new("vllm_delta", bucket_size=1 << 20, **kwargs)
    for rank, engine in enumerate((rank0, rank1)):
        engine.prepare()
        engine.init_process_group(**{k: v[rank] for k, v in actor.items()})
    weights = load_file(f"{model_dir}/model.safetensors")
    report = {"received": [], "metrics": []}
    for step in (1, 2):
        gen = torch.Generator().manual_seed(step)
        for t in weights.values():
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.shape, generator=gen) < 0.02] += 1

        report["metrics"].append(asyncio.run(sync(rank0, rank1, weights, step, report)))
        rank0.finalize()
        rank1.finalize()
    save_file({n: t.contiguous() for n, t in weights.items()}, out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
