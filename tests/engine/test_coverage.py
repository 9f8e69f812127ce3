"""The startup coverage check: every checkpoint element held by the ranks that should hold it.

Why: an empty placement on a rank is either "another rank holds it" or "the probe missed it";
only the ranks together can tell (issue 10, "Why" 4). The ranks here are purpose-built modules,
each a TP shard of the same checkpoint, probed for real; their `delta_coverage`-shaped replies
go through `check_coverage` as the route hands them over. No engine.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_placement import (
    CHECKPOINT,
    MAPPABLE,
    H,
    LocalWorker,
    loaded,
    perturbed,
    random_checkpoint,
    write_delta,
)
from torch import nn

from vllm_delta.engine import digests
from vllm_delta.engine.digests import CoverageError, check_coverage, coverage, refuse_uncovered
from vllm_delta.engine.probe import build_placement

R, C = 8, 6
SHAPES = {
    "rows.weight": (R, C),
    "cols.weight": (R, C),
    "norm.weight": (C,),
    "kv.weight": (R // 2, C),
    "inv_freq": (C // 2,),
}


class Shard(nn.Module):
    """Rank `rank` of `tp`: rows split, columns split, a replicated norm, kv rows replicated in
    pairs of ranks (tp=4 over 2 kv heads), an ignored tensor. `drop` / `grab` break one loader."""

    def __init__(self, rank: int, tp: int, drop: str | None = None, grab: str | None = None) -> None:
        super().__init__()
        self.rank, self.tp, self.drop, self.grab = rank, tp, drop, grab
        self.rows = nn.Parameter(torch.zeros(R // tp, C), requires_grad=False)
        self.cols = nn.Parameter(torch.zeros(R, C // (2 if tp > 1 else 1)), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(C), requires_grad=False)
        kv_ranks = max(1, tp // 2)  # ranks sharing one kv head
        self.kv = nn.Parameter(torch.zeros(R // 2 // max(1, tp // kv_ranks), C), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "inv_freq":
                continue  # vLLM skips rotary inv_freq without reading it
            if name == self.drop:
                w.sum()  # read, then (a broken loader) written nowhere we can see
                continue
            if name == "rows.weight":
                n = R // self.tp
                start = self.rank * n if name != self.grab else 0  # `grab`: every rank takes rank 0's rows
                self.rows.data.copy_(w.narrow(0, start, n))
            elif name == "cols.weight":
                n = self.cols.shape[1]
                self.cols.data.copy_(w.narrow(1, (self.rank % 2) * n if self.tp > 1 else 0, n))
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            elif name == "kv.weight":
                n = self.kv.shape[0]
                heads = R // 2 // n
                self.kv.data.copy_(w.narrow(0, (self.rank * heads // self.tp) * n, n))


def replies(tp: int, **broken) -> list[dict]:
    """What every rank's `delta_coverage` returns, from a real probe of its shard."""
    out = []
    for rank in range(tp):
        m = Shard(rank, tp, **(broken if rank == tp - 1 else {}))
        storages = {p.untyped_storage().data_ptr(): n for n, p in m.named_parameters()}
        placements = build_placement(
            m.load_weights, storages, {n: (s, torch.float32) for n, s in SHAPES.items()}
        )
        out.append(
            {
                "rank": rank,
                "coverage": coverage(placements),
                "unread": [n for n, p in placements.items() if not p.read],
                "fallback": [n for n, p in placements.items() if p.fallback_reason],
            }
        )
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_full_coverage_passes(tp):
    """Split (rows, cols at tp 4 held by 2 ranks each), replicated (norm) and kv-replicated all pass."""
    report = check_coverage(replies(tp), SHAPES)
    assert report == {"ok": True, "errors": {}, "ignored": ["inv_freq"]}
    refuse_uncovered(report)  # does not raise


def test_empty_placement_on_every_rank_is_a_hole():
    report = check_coverage(_all_drop("norm.weight"), SHAPES)
    assert not report["ok"] and list(report["errors"]) == ["norm.weight"]
    assert "no rank holds any element" in report["errors"]["norm.weight"]
    with pytest.raises(CoverageError) as exc:
        refuse_uncovered(report)
    assert exc.value.param == "norm.weight" and exc.value.http_status == 500


def _all_drop(name: str) -> list[dict]:
    """Both ranks read the tensor and hold none of it: what a probe that misses every write sees."""
    both = replies(2)
    for r in both:
        r["coverage"].pop(name)
    return both


def test_rows_one_rank_missed_are_a_hole():
    report = check_coverage(replies(2, drop="rows.weight"), SHAPES)
    assert list(report["errors"]) == ["rows.weight"]
    assert f"elements [{R // 2 * C}, {R * C}) are held by no rank" in report["errors"]["rows.weight"]


def test_two_ranks_holding_the_same_rows_is_an_overlap_and_a_hole():
    report = check_coverage(replies(2, grab="rows.weight"), SHAPES)
    assert list(report["errors"]) == ["rows.weight"], report
    assert "held by no rank" in report["errors"]["rows.weight"]


def test_uneven_replication_is_an_overlap():
    """Rank 1 also holds rank 0's rows: rows 0.. by two ranks, the rest by one."""
    reps = replies(2)
    reps[1]["coverage"]["rows.weight"] = (
        reps[1]["coverage"]["rows.weight"] + reps[0]["coverage"]["rows.weight"]
    )
    report = check_coverage(reps, SHAPES)
    assert list(report["errors"]) == ["rows.weight"]
    assert "ranks overlap" in report["errors"]["rows.weight"]


def test_fragmented_lattices_are_checked():
    """Every other column on each of two ranks: a run per element."""
    shape = (R, C)
    even = (0, (R, C // 2), (C, 2))
    odd = (1, (R, C // 2), (C, 2))
    ok = [{"coverage": {"w": [even]}}, {"coverage": {"w": [odd]}}]
    assert digests._coverage_error("w", R * C, [[even], [odd]]) is None
    assert "held by no rank" in digests._coverage_error("w", R * C, [[even], []])
    assert "ranks overlap" in digests._coverage_error("w", R * C, [[even, odd], [odd]])
    assert check_coverage(ok, {"w": shape})["ok"]


def test_a_fallback_tensor_is_left_to_vllms_loader():
    reps = _all_drop("norm.weight")
    reps[0]["fallback"] = ["norm.weight"]
    assert check_coverage(reps, SHAPES)["ok"]


def test_a_hole_found_at_startup_refuses_updates_and_shows_in_status(tmp_path):
    """Through the worker extension: the report lands in the status; prepare refuses, naming the tensor."""
    old = random_checkpoint(0)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(old, str(model_dir / "model.safetensors"))
    root = tmp_path / "root"
    delta = write_delta(root / "d", old, perturbed(old, MAPPABLE, seed=7))
    worker = LocalWorker(loaded(old), model_dir)
    before = {n: p.clone() for n, p in worker.model_runner.get_model().named_parameters()}
    request = {"id": "r1", "path": str(delta), "root": str(root), "version": 1, "base_version": 0}

    reply = worker.delta_coverage()
    assert set(reply["coverage"]) == set(CHECKPOINT) - {"scaled.weight", "filled.weight"}  # the two fall back
    # The other TP rank: it holds the rows of shard.weight this module leaves out.
    peer = {"rank": 1, "coverage": {"shard.weight": [(0, (H, H), (H, 1))]}, "unread": [], "fallback": []}
    reply["coverage"].pop("q.weight")  # as if the probe had missed every write of q
    report = worker.delta_set_peers([reply, peer])["coverage"]
    assert not report["ok"] and list(report["errors"]) == ["q.weight"]
    assert worker.delta_status()["placement"]["coverage"] == report
    refused = worker.delta_prepare(request)
    assert not refused["ok"] and refused["status"] == 500
    assert refused["error"]["type"] == "CoverageError" and refused["error"]["param"] == "q.weight", refused
    assert all(torch.equal(p, before[n]) for n, p in worker.model_runner.get_model().named_parameters())

    assert worker.delta_set_peers([worker.delta_coverage(), peer])["coverage"][
        "ok"
    ]  # the same delta, fully held
    assert worker.delta_prepare(request)["ok"]
