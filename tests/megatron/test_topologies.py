"""The hook on real megatron-core (CPU, gloo) at TP=2, EP=2 (MoE), PP=2 and DP=2 with the
distributed optimizer + overlap_param_gather, and GLM4-MoE at EP=2 (its fp32 `router.expert_bias`
buffer, HF `e_score_correction_bias`, moves outside the optimizer): after each of 3 steps, the union of every rank's
shipped entries, written into mbridge's export of the previous weights, equals mbridge's export
of the new weights bit for bit, and no element is shipped twice. mbridge's export gathers real
weights over real collectives; the hook's map never gathers, so the two paths are independent."""

from __future__ import annotations

import pytest

from harness import megatron_cpu
from hook_workers import topology_worker

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]
STEPS = 3


@pytest.mark.parametrize("family,world,tp,ep,pp,distopt", [
    ("llama", 2, 2, 1, 1, False),
    ("qwen3_moe", 2, 1, 2, 1, False),
    ("llama", 2, 1, 1, 2, False),
    ("llama", 2, 1, 1, 1, True),
    ("glm4_moe", 2, 1, 2, 1, False),
], ids=["tp2", "ep2_moe", "pp2", "dp2_distopt_overlap", "ep2_glm4moe_expert_bias"])
def test_shipped_entries_reproduce_the_export(tiny_model_factory, family, world, tp, ep, pp, distopt):
    hf = str(tiny_model_factory(family))
    megatron_cpu.spawn(topology_worker, world, hf, tp, ep, pp, distopt, STEPS, family, timeout=400)
