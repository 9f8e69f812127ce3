"""Each TP rank decodes only the position blocks it owns, and the apply stays bit-exact.

The synthetic vLLM-shaped model (benchmarks/device_check.py) at TP=2: its vocab-parallel
embedding and lm_head, and the q/k/v and gate/up row blocks, are row splits, so each rank's
share of those tensors is a contiguous position range; norms are replicated (both ranks need
every block) and row-parallel layers are column splits (their ranges span the whole tensor).
"""

from __future__ import annotations

import torch
from harness.synthetic import device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import Ownership, check_partials, coverage
from vllm_delta.engine.placement import Segment, TensorPlacement, owned_by_tensor
from vllm_delta.wire import iter_delta, load_manifest
from vllm_delta.wire.blocks import Policy

DC = device_check()
CFG = DC.SIZES["tiny"]
META = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(CFG).items()}
SMALL = Policy(span_bits=5, min_entries=8, max_entries=16)  # many blocks in tiny tensors
EMBED = "model.embed_tokens.weight"


def owned_ranges(placement: TensorPlacement) -> list[tuple[int, int]] | None:
    return owned_by_tensor({placement.name: placement})[placement.name]


def test_owned_ranges_of_synthetic_placements():
    rows = Segment("w", (4, 8), 32, (8, 1), 0, (8, 1))  # rows 4..7 of an [8, 8] tensor
    cols = Segment("w", (8, 4), 4, (8, 1), 0, (4, 1))  # columns 4..7 of every row
    more = Segment("w2", (2, 8), 0, (8, 1), 0, (8, 1))  # rows 0..1, into another target
    assert owned_ranges(TensorPlacement("w", (8, 8), torch.bfloat16, [rows])) == [(32, 63)]
    assert owned_ranges(TensorPlacement("w", (8, 8), torch.bfloat16, [cols])) == [(4, 63)]
    assert owned_ranges(TensorPlacement("w", (8, 8), torch.bfloat16, [rows, more])) == [(0, 15), (32, 63)]
    assert owned_ranges(TensorPlacement("w", (8, 8), torch.bfloat16, [])) == []  # another rank holds it
    fallback = TensorPlacement("w", (8, 8), torch.bfloat16, [], fallback_reason="unmappable")
    assert owned_ranges(fallback) is None  # replayed whole: needs every position


def write_delta(
    path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], blocked: bool = True
) -> None:
    """A block-indexed delta (or a `vllm-delta/1` one) with the sender's digests of the changed positions."""
    DC.write_delta(path, old, new, version=1, block_policy=SMALL, blocked=blocked)


def tp2_appliers(tmp_path, base: dict[str, torch.Tensor]) -> list[tuple[torch.nn.Module, DeltaApplier]]:
    """Two TP ranks of the synthetic model on `base`, each applier knowing what its peer holds."""
    models, _ = tp_ranks(tmp_path / "model", base, tp=2)
    appliers = [DeltaApplier(model, META, rank=rank) for rank, model in enumerate(models)]
    covs = [coverage(a.placements) for a in appliers]
    for rank, applier in enumerate(appliers):
        applier.ownership = Ownership.from_coverages(covs, rank)
    return list(zip(models, appliers))


def test_each_tp_rank_decodes_fewer_blocks_and_applies_bit_exact(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=7)
    write_delta(tmp_path / "d", base, new)
    replies = []
    for rank, (model, applier) in enumerate(tp2_appliers(tmp_path, base)):
        owned = owned_by_tensor(applier.placements)
        embed = next(
            pd for pd in iter_delta(tmp_path / "d", current_version=0, owned=owned) if pd.name == EMBED
        )
        assert 0 < embed.blocks[0] < embed.blocks[1] and embed.skipped > 0  # a row split: half the blocks
        staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
        assert 0 < staged.blocks[0] < staged.blocks[1]
        assert staged.total_changed == sum(p.changed for p in load_manifest(tmp_path / "d").params)
        replies.append({"digests": staged.digests, "expected": staged.expected})
        applier.commit(staged)
        assert same_bits(model, loaded(new, rank, 2)) == []
    # Skipped blocks hold only elements a rank does not hold, so the counted-once partials still add up.
    assert check_partials(replies) == 2 * len(replies[0]["expected"])


def test_unblocked_v1_deltas_still_apply_bit_exact(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=8)
    write_delta(tmp_path / "d", base, new, blocked=False)
    replies = []
    for rank, (model, applier) in enumerate(tp2_appliers(tmp_path, base)):
        staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
        assert staged.blocks == (0, 0)  # no index: every rank decodes everything, as before
        replies.append({"digests": staged.digests, "expected": staged.expected})
        applier.commit(staged)
        assert same_bits(model, loaded(new, rank, 2)) == []
    assert check_partials(replies) == 2 * len(replies[0]["expected"])
