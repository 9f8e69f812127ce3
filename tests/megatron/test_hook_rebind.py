"""Never silently frozen (issue 18): the hook's segments are views of the weights taken at
register(). A trainer that then rebinds `param.data` (offload/onload) must still have every change
shipped, checked against mbridge's own export on real megatron-core (1 gloo rank, tiny Llama); a
rebind the views cannot follow raises, naming the weight."""

from __future__ import annotations

import pytest
from harness import megatron_cpu
from hook_workers import rebind_worker

pytestmark = [pytest.mark.megatron, pytest.mark.heavy]


def test_rebound_weights_are_followed_or_refused(tiny_model_factory):
    megatron_cpu.spawn(rebind_worker, 1, str(tiny_model_factory("llama")), timeout=300)
