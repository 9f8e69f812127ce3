"""Counted-once digests decided at startup (issue 16, "Why" 2), and the coverage check per class.

Why: a rank counts in its digests only the elements no lower rank holds. Deciding that per
changed position on every update cost ~0.4 us per position (minutes per sync at 355B), though
almost every tensor is a disjoint TP shard ("all") or replicated ("none"). `Ownership` now
decides it per tensor at startup; prepare pays one constant-size op for "all" / "none". The
shards are test_coverage's purpose-built modules, probed for real; the brute-force reference is
an element-by-element set computation, not the run arithmetic under test.
"""

from __future__ import annotations

import pytest
import torch
from harness.dispatch_log import OpCount
from test_coverage import SHAPES, replies

from vllm_delta.engine import digests
from vllm_delta.engine.digests import Ownership, check_coverage, lattice_parts


def held(lats) -> set[int]:
    """Every checkpoint id a list of lattices holds, enumerated one by one."""
    out = set()
    for lat in lats:
        offset, sizes, strides = lattice_parts(lat)
        ids = [offset]
        for n, s in zip(sizes, strides):
            ids = [i + k * s for i in ids for k in range(n)]
        out.update(ids)
    return out


def expected_share(covs, rank: int, name: str) -> str:
    mine = held(covs[rank].get(name, ()))
    lower = held([lat for c in covs[:rank] for lat in c.get(name, ())])
    both = mine & lower
    return "all" if not both else "none" if both == mine else "some"


@pytest.mark.parametrize("tp", [2, 4])
def test_shares_match_a_brute_force_count_and_masks_only_where_needed(tp):
    covs = [r["coverage"] for r in replies(tp)]
    for rank in range(tp):
        own = Ownership.from_coverages(covs, rank)
        for name in covs[rank]:
            want = expected_share(covs, rank, name)
            assert own.share(name) == want, (rank, name)
            mine = sorted(held(covs[rank][name]))
            lower = held([lat for c in covs[:rank] for lat in c.get(name, ())])
            mask = own.counted(name, torch.tensor(mine))  # prepare asks only about what this rank holds
            assert [i for i, keep in zip(mine, mask.tolist()) if keep] == sorted(set(mine) - lower), (
                rank,
                name,
            )
    # At tp=4 the last rank shares its kv rows with rank 2 and its norm with everyone: "none";
    # its row shard is its own: "all". Nothing needs a mask.
    last = Ownership.from_coverages(covs, tp - 1)
    assert last.share("rows.weight") == "all" and last.share("norm.weight") == "none"
    assert "some" not in last.shares.values()


def test_a_decided_share_costs_one_op_whatever_the_lower_ranks_hold():
    covs = [r["coverage"] for r in replies(4)]
    own = Ownership.from_coverages(covs, 3)
    pos = torch.arange(1 << 12)
    for name in ("rows.weight", "norm.weight"):
        with OpCount() as ops:
            own.counted(name, pos)
        assert ops.count == 1, name


def test_a_partial_overlap_keeps_a_per_position_mask():
    # Rank 1 holds ids 0..5, rank 0 ids 0..2: three of rank 1's elements are counted by rank 0.
    covs = [{"t": [(0, (3,), (1,))]}, {"t": [(0, (6,), (1,))]}]
    own = Ownership.from_coverages(covs, 1)
    assert own.share("t") == "some" and own.shares == {"t": "some"}
    assert own.counted("t", torch.arange(6)).tolist() == [False] * 3 + [True] * 3


def test_coverage_verdicts_are_computed_once_per_structural_class(monkeypatch):
    reps = replies(4)
    calls = []
    original = digests._coverage_error
    monkeypatch.setattr(digests, "_coverage_error", lambda *a, **k: calls.append(a[0]) or original(*a, **k))
    # 50 copies of each tensor (layers): the same lattices, so one verdict per tensor kind.
    shapes = {f"l{i}.{n}": s for i in range(50) for n, s in SHAPES.items()}
    for r in reps:
        r["coverage"] = {f"l{i}.{n}": lats for i in range(50) for n, lats in r["coverage"].items()}
        r["unread"] = [f"l{i}.{n}" for i in range(50) for n in r["unread"]]
    report = check_coverage(reps, shapes)
    assert report["ok"] and len(report["ignored"]) == 50
    assert len(calls) == 4  # rows, cols, norm, kv: one structural class each
