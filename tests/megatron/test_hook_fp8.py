"""End to end: the hook at TP=2 (real megatron-core under gloo, a bf16 trainer) syncs a real CPU
`vllm serve` of a block-fp8 checkpoint for 3 steps.

After each step:
- every rank's shipped codes, `weight_scale_inv` values and bf16 tensors, written into the reference's
  export of the previous weights, equal the reference quantizer (vLLM's own `per_block_cast_to_fp8`)
  applied to mbridge's export of the trainer's new bf16 weights, bit for bit; each changed code and
  scale is shipped exactly once, and nothing else. Each rank quantized only its own shard (the aligned
  layout's TP shards are whole 128x128 blocks), so this holds its blocks to the reference's whole-tensor
  ones;
- the engine's `/weight_checker` digests equal a fresh load (vLLM's own loader, another process) of that
  reference export, and its greedy tokens and logprobs equal its own after vLLM's `reload_weights` of the
  export (done once the sync is over, per step; the digests cover every live tensor the matmuls read, the
  VNNI-packed weights included, so the reload adds the outputs' check: another engine would cost a start).
Before that, a layout whose TP shard cuts a block is refused at `register()` on every rank.
The engine runs vLLM's CPU block-fp8 kernel through `harness.fp8_engine` (CPUs without AMX too): the
fp8 modules' shared engine, put on the served checkpoint by vLLM's `reload_weights` first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch
from fp8_hook_workers import (
    ALIGNED,
    STRADDLING,
    fp8_worker,
    load_checkpoint,
    quantized,
    reference_export,
    write_pair,
)
from harness import fp8_engine, megatron_cpu
from harness.engine_pool import API_KEY, HEADERS, status
from harness.fresh_load import save_checkpoint
from harness.vllm_engine import served_greedy

pytestmark = [pytest.mark.megatron, pytest.mark.engine, pytest.mark.heavy]
STEPS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def reload(url: str, checkpoint: Path) -> None:
    """vLLM's in-place full load of `checkpoint` (dev-mode `/collective_rpc`)."""
    r = requests.post(
        f"{url}/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}},
        headers=HEADERS,
        timeout=600,
    )
    r.raise_for_status()


def test_tp2_hook_syncs_a_block_fp8_engine_as_the_reference_quantizes(tmp_path, engine_pool, fresh_loader):
    straddling = write_pair(tmp_path / "straddling", STRADDLING)
    bf16, served = write_pair(tmp_path / "aligned", ALIGNED, tokenizer=True)
    out = tmp_path / "steps"
    out.mkdir()
    server = fp8_engine.shared_server(engine_pool)  # test_fp8_served's engine, if it ran first here
    try:
        reload(server.url, served)  # the trainer's quantized weights, which register() seeds from
        engine = {
            "url": server.url,
            "root": str(engine_pool.delta_root()),
            "api_key": API_KEY,
            "version": status(server.url)["version"],
        }
        pair = (str(bf16), str(served))
        megatron_cpu.spawn(
            fp8_worker, 2, tuple(map(str, straddling)), pair, engine, STEPS, str(out), timeout=600
        )
        prev = {n: _bits(t) for n, t in load_checkpoint(served).items()}
        shipped: set[str] = set()
        for step in range(STEPS):
            got = torch.load(out / f"{step}.pt")
            export = reference_export(got["export"])
            want = {n: _bits(t) for n, t in export.items()}
            assert want.keys() == prev.keys()
            applied = {n: t.clone().reshape(-1) for n, t in prev.items()}
            sent = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in prev.items()}
            for name, pos, vals in got["entries"]:
                applied[name][pos] = _bits(vals)
                sent[name][pos] += 1
            bad = [n for n in want if not torch.equal(applied[n], want[n].reshape(-1))]
            assert not bad, f"step {step}: shipped entries do not reproduce the reference's export: {bad[:5]}"
            for n in want:
                moved = prev[n].reshape(-1) != want[n].reshape(-1)
                assert torch.equal(sent[n] > 0, moved) and int(sent[n].max()) <= 1, (step, n)
            shipped |= {n for n, s in sent.items() if int(s.sum())}
            prev = want
            path = save_checkpoint(export, served, tmp_path / f"export{step}")
            assert got["checksums"] == fresh_loader.checksums(path), step
            reload(server.url, path)
            assert served_greedy(server.url, HEADERS) == got["outputs"], step
    finally:
        server.stop()  # the last module of the fp8 scope (tests/conftest.py): nothing uses it after
    codes = {n for n in shipped if quantized(n)}
    assert codes and {n + "_scale_inv" for n in codes} & shipped, sorted(shipped)
    assert any(n.endswith("k_proj.weight") for n in codes)  # both ranks' halves of a split projection
