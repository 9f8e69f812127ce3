"""The hook's contract on real megatron-core (1 gloo rank, tiny Llama via mbridge): a model one
bf16 element off the served checkpoint is reported at registration, naming exactly the element
mbridge's own export shows; a step megatron's loss scaler skips (non-finite gradients) syncs
nothing and moves no weight; a real step syncs once; remove() puts the optimizer's step back."""

from __future__ import annotations

import json

import pytest
from harness import megatron_cpu
from hook_workers import behaviour_worker

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]


def test_mismatch_report_skipped_step_and_remove(tiny_model_factory, tmp_path):
    out = tmp_path / "expect.json"
    megatron_cpu.spawn(behaviour_worker, 1, str(tiny_model_factory("llama")), str(out), timeout=300)
    expect = json.loads(out.read_text())
    # Row 0 of linear_qkv is q row 0 of query group 0 (hidden 128): element 77 is q_proj's 77.
    assert expect == {"model.layers.1.self_attn.q_proj.weight": [77]}, expect
