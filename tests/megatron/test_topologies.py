"""The hook on real megatron-core (CPU, gloo) at TP=2 with a padded vocab, EP=2 (MoE), PP=2 and DP=2
with the distributed optimizer + overlap_param_gather, and GLM4-MoE at EP=2 (its fp32
`router.expert_bias` buffer, HF `e_score_correction_bias`, moves outside the optimizer).

After each of 3 steps, the union of every rank's shipped entries, written into mbridge's export of
the previous weights, equals mbridge's export of the new weights bit for bit, each changed element
is shipped exactly once, and nothing else is. mbridge's export gathers real weights over real
collectives; the hook's map never gathers, so the two paths are independent.
- PP=2 steps through megatron-core's own 1F1B schedule (`get_forward_backward_func`, p2p over
  gloo); each stage may ship only its own layers (embedding first, norm and lm_head last), and
  both stages ship.
- TP=2 pads the vocab to 768 rows (`make_vocab_size_divisible_by=384`) over HF's 512: each rank's
  map covers only its real rows, the padded output-layer rows do change in training, and the
  export (which drops them) is still reproduced exactly.
"""

from __future__ import annotations

import pytest
from harness import megatron_cpu
from hook_workers import topology_worker

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]
STEPS = 3


@pytest.mark.parametrize(
    "family,world,tp,ep,pp,distopt,vocab_multiple",
    [
        ("llama", 2, 2, 1, 1, False, 384),
        ("qwen3_moe", 2, 1, 2, 1, False, None),
        ("llama", 2, 1, 1, 2, False, None),
        ("llama", 2, 1, 1, 1, True, None),
        ("glm4_moe", 2, 1, 2, 1, False, None),
    ],
    ids=["tp2_padded_vocab", "ep2_moe", "pp2_schedule", "dp2_distopt_overlap", "ep2_glm4moe_expert_bias"],
)
def test_shipped_entries_reproduce_the_export(
    tiny_model_factory, family, world, tp, ep, pp, distopt, vocab_multiple
):
    hf = str(tiny_model_factory(family))
    megatron_cpu.spawn(
        topology_worker, world, hf, tp, ep, pp, distopt, STEPS, family, vocab_multiple, timeout=400
    )
