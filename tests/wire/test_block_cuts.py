"""`blocks.cuts` finds window edges with one search per edge when the positions span fewer windows
than they hold entries (a pass over every position otherwise, the encode's costliest after zstd);
both must give the cuts the module's rule defines, which is spelled out here in plain Python."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_delta.wire.blocks import Policy, cuts


def _rule(pos: list[int], policy: Policy) -> list[int]:
    """The block starts the rule defines: window changes rounded down to a multiple of 8, kept once the
    block holds `min_entries`, then every block cut at `max_entries`."""
    n = len(pos)
    starts = [0]
    for i in range(1, n):
        if pos[i] >> policy.span_bits != pos[i - 1] >> policy.span_bits:
            c = i & ~7
            if c - starts[-1] >= policy.min_entries:
                starts.append(c)
    out = []
    for a, b in zip(starts, starts[1:] + [n]):
        out.extend(range(a, b, policy.max_entries))
    return out


@pytest.mark.parametrize(
    "policy",
    [
        Policy(),
        Policy(span_bits=6, min_entries=8, max_entries=64),
        Policy(span_bits=0, min_entries=0, max_entries=8),
        Policy(span_bits=3, min_entries=1, max_entries=16),
    ],
)
@pytest.mark.parametrize("density", [1.0, 0.3, 0.02, 1e-4])
def test_cuts_follow_the_rule_whichever_way_they_are_found(policy: Policy, density: float) -> None:
    rng = np.random.default_rng(int(density * 1e4) + policy.span_bits)
    for numel in (1, 9, 4096, 3 << 20):
        n = min(max(1, int(numel * density)), 20_000)  # the plain-Python rule is slow
        pos = np.sort(rng.choice(numel, size=min(n, numel), replace=False)).astype(np.int64)
        assert cuts(pos, policy) == _rule(pos.tolist(), policy), (numel, density)
    assert cuts(np.zeros(0, dtype=np.int64), policy) == []
    far = np.array([0, 1, 5 << 40, (5 << 40) + 3, 1 << 61], dtype=np.int64)  # more windows than entries
    assert cuts(far, policy) == _rule(far.tolist(), policy)
