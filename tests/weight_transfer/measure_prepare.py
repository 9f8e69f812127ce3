"""Tokens generated during native-door prepares, with `prepare_s` and `pause_s` (not a test).

Usage (under the engine lock): `flock /tmp/engine.lock .venv/bin/python
tests/weight_transfer/measure_prepare.py
--tp 1 --rounds 3 --updates 10 --streams 3 [--fresh-check]`. One `vllm serve` of the suite's tiny
Llama with the `delta` backend; per round, greedy streaming clients run back to back while a
corrupt delta is refused and then `--updates` deltas moving 50% of every tensor apply through
vLLM's start / update / finish routes. `--fresh-check` then compares `/weight_checker` with a
fresh engine (same backend) loaded from the final weights. Prints one JSON line. The numbers in
docs/results/prepare_while_serving.md ("Native door") came from this sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402
from native_helpers import NATIVE, Streams, checksums, native_update, write_delta  # noqa: E402

from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV  # noqa: E402


def moved(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor with a seeded half of its elements moved by one ULP."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for name, t in weights.items():
        t = t.clone()
        bits = t.view(-1).view(torch.int16)
        bits[torch.rand(bits.shape, generator=gen) < 0.5] += 1
        out[name] = t
    return out


def corrupted(good: Path) -> Path:
    out = good.with_name(good.name + "-corrupt")
    shutil.copytree(good, out)
    flush = next(out.glob("*.safetensors"))
    data = bytearray(flush.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flush.write_bytes(bytes(data))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--fresh-check", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="native_prepare_"))
    model = make_tiny_model("llama", work / "model")
    root = Path(os.path.realpath(work / "root"))
    root.mkdir()
    env = {ROOT_ENV: str(root), "VLLM_PLUGINS": "delta_updates"}
    weights, version, out = load_file(model / "model.safetensors"), 0, {"tp": args.tp, "rounds": []}
    with VllmServer(model, work / "serve.log", tp=args.tp, extra_args=NATIVE, env=env) as server:
        for rnd in range(args.rounds):
            chain = []
            for i in range(args.updates):
                new = moved(weights, seed=100 * rnd + i)
                chain.append(write_delta(root, f"r{rnd}u{i}", new, weights, version + i + 1, version + i))
                weights = new
            bad, before, updates = corrupted(chain[0]), checksums(server.url), []
            with contextlib.ExitStack() as stack:
                streams = [stack.enter_context(Streams(server.url, 240)) for _ in range(args.streams)]
                r, _ = native_update(
                    server.url,
                    {"path": bad.name, "version": version + 1, "base_version": version},
                    str(version + 1),
                )
                refused = [r.status_code, r.json()["error"]["type"], checksums(server.url) == before]
                for path in chain:
                    version += 1
                    r, done = native_update(
                        server.url,
                        {"path": path.name, "version": version, "base_version": version - 1},
                        str(version),
                    )
                    assert r.status_code == 200, r.text
                    updates.append({k: done[k] for k in ("prepare_s", "pause_s", "tokens_during_prepare")})
            out["rounds"].append(
                {
                    "refused": refused,
                    "streams": [c for s in streams for c in s.counts],
                    "updates": updates,
                    "median": {k: statistics.median(u[k] for u in updates) for k in updates[0]},
                }
            )
        served = checksums(server.url)
    if args.fresh_check:
        fresh_dir = work / "fresh"
        shutil.copytree(model, fresh_dir)
        save_file(weights, str(fresh_dir / "model.safetensors"), metadata={"format": "pt"})
        # The same backend: CPU linear layers keep their full weights where /weight_checker sees them.
        with VllmServer(fresh_dir, work / "fresh.log", tp=args.tp, extra_args=NATIVE, env=env) as server:
            fresh = checksums(server.url)
        out["fresh_check"] = {"equal": served == fresh, "params": len(served)}
    print(json.dumps(out))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
