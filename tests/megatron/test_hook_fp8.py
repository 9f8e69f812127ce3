"""The hook into block-fp8 engines from a bf16 trainer at TP=2 (real megatron-core under gloo).

After each of 3 steps, every rank's shipped codes, `weight_scale_inv` values and bf16 tensors, written
into the reference's export of the previous weights, equal the reference quantizer (vLLM's own
`per_block_cast_to_fp8`) applied to mbridge's export of the trainer's new bf16 weights, bit for bit;
each changed code and scale is shipped exactly once, and nothing else. Each rank quantized only its own
shard (the aligned layout's shards are whole 128x128 blocks), so this checks the per-rank blocks against
the reference's whole-tensor ones. A layout whose shard cuts a block is refused at `register()`.
"""

from __future__ import annotations

import pytest
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
from harness import megatron_cpu

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]
STEPS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_tp2_hook_ships_the_reference_quantization_of_each_step(tmp_path):
    straddling = write_pair(tmp_path / "straddling", STRADDLING)
    aligned = write_pair(tmp_path / "aligned", ALIGNED)
    out = tmp_path / "steps"
    out.mkdir()
    megatron_cpu.spawn(
        fp8_worker, 2, *map(lambda p: tuple(map(str, p)), (straddling, aligned)), STEPS, str(out), timeout=400
    )
    prev = {n: _bits(t) for n, t in load_checkpoint(aligned[1]).items()}
    shipped: set[str] = set()
    for step in range(STEPS):
        got = torch.load(out / f"{step}.pt")
        want = {n: _bits(t) for n, t in reference_export(got["export"]).items()}
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
    codes = {n for n in shipped if quantized(n)}
    assert codes and {n + "_scale_inv" for n in codes} & shipped, sorted(shipped)
    assert any(n.endswith("k_proj.weight") for n in codes)  # both ranks' halves of a split projection
