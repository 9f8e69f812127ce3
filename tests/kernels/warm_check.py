"""Run as a script (a fresh interpreter: nothing compiled yet): `warm_up`, then a sender's scans and
encode of a delta and an engine's apply of it, on the device check's synthetic model; prints the
kernels' signatures compiled after `warm_up` as JSON (none, when it covers a sync)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from harness.kernel_signatures import signatures
from harness.synthetic import device_check

from vllm_delta.kernels.warmup import warm_up


def main(encoding: str) -> None:
    from vllm_delta.engine.apply import DeltaApplier
    from vllm_delta.sender import Shard
    from vllm_delta.sender.producer import Producer

    DC = device_check()
    cfg = DC.SIZES["tiny"]
    base = DC.random_checkpoint(cfg, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    warm_up({t.dtype for t in base.values()}, sender=True)  # both sides, as the engine and the sender do
    before = signatures()
    producer = Producer(snapshot="device", post_hash=False)
    live = {n: t.clone() for n, t in base.items()}
    shards = [Shard.whole(n, t) for n, t in live.items()]
    producer.seed([Shard.whole(n, t.clone()) for n, t in live.items()])
    for n, t in live.items():
        t.copy_(new[n])
    producer.scan(shards, kind="delta", anchor=False)
    with tempfile.TemporaryDirectory() as tmp:
        DC.write_delta(Path(tmp) / "d", base, new, version=1, encoding=encoding)
        meta = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(cfg).items()}
        model = DC.SyntheticLM(cfg)
        model.load_weights(base.items())
        applier = DeltaApplier(model, meta)
        applier.commit(applier.prepare(Path(tmp) / "d", version=1, base_version=0, current_version=0))
    after = signatures()
    print(json.dumps({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}))


if __name__ == "__main__":
    main(sys.argv[1])
