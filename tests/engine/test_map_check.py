"""The startup map check (engine/map_check.py): the probe's map against the loader run for real.

Why: every later check (digests, verify) goes through the map, so a map wrong in the same way
everywhere passes them all (issue 16, "Why" 7). Here the map of a vLLM-like module is checked
against its own loader on random values; a deliberately corrupted map must be named, and its
error must refuse updates through the startup coverage report. No engine (the real-vLLM loader
version is tests/scale/test_full_shape.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_placement import CHECKPOINT, PackedModule, loaded, random_checkpoint, storages
from torch import nn

from vllm_delta.engine.digests import CoverageError, check_coverage, coverage, refuse_uncovered
from vllm_delta.engine.map_check import check_map
from vllm_delta.engine.probe import build_placement


def mapped(m: PackedModule) -> dict:
    return build_placement(m.load_weights, storages(m), CHECKPOINT)


def params(m: PackedModule) -> dict[str, torch.Tensor]:
    return dict(m.named_parameters())


def test_a_correct_map_agrees_with_the_loader_and_writes_no_weight():
    m = loaded(random_checkpoint(0))
    before = {n: p.clone() for n, p in m.named_parameters()}
    assert check_map(m.load_weights, params(m), mapped(m), CHECKPOINT) == {}
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


@pytest.mark.parametrize("field,delta", [("dst_offset", 1), ("src_offset", 1), ("dst_strides", None)])
def test_a_corrupted_map_is_named_and_refuses_updates(field, delta):
    m = PackedModule()
    placements = mapped(m)
    seg = placements["k.weight"].segments[0]
    if delta is None:  # the destination's row stride halved: rows land interleaved
        bad = dataclasses.replace(seg, dst_strides=(seg.dst_strides[0] // 2, *seg.dst_strides[1:]))
    else:
        bad = dataclasses.replace(seg, **{field: getattr(seg, field) + delta})
    placements["k.weight"].segments[0] = bad
    errors = check_map(m.load_weights, params(m), placements, CHECKPOINT)
    assert list(errors) == ["qkv"] and "placement map" in errors["qkv"]
    reply = {
        "rank": 0,
        "coverage": coverage(placements),
        "unread": [],
        "map_errors": errors,
        "fallback": [n for n, p in placements.items() if p.fallback_reason],
    }
    report = check_coverage([reply], {n: s for n, (s, _) in CHECKPOINT.items()})
    assert not report["ok"] and "qkv" in report["errors"]
    with pytest.raises(CoverageError, match="placement map"):
        refuse_uncovered(report)


def test_a_missing_segment_is_caught():
    m = PackedModule()
    placements = mapped(m)
    placements["v.weight"].segments.clear()  # the map forgets where v lands; the loader still writes it
    placements["v.weight"].read = True
    errors = check_map(m.load_weights, params(m), placements, CHECKPOINT)
    assert list(errors) == ["qkv"], errors


class Shared(nn.Module):
    """One parameter registered under two names, as vLLM registers a MoE gate's correction bias."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.experts = nn.Module()
        self.experts.bias = self.gate

    def load_weights(self, weights) -> None:
        for _, w in weights:
            self.gate.data.copy_(w)


def test_a_parameter_under_two_names_is_checked_by_its_storage():
    m = Shared()
    named = dict(m.named_parameters(remove_duplicate=False))
    last_wins = {p.untyped_storage().data_ptr(): n for n, p in named.items()}  # as the engine's probe keys it
    ckpt = {"bias": ((4,), torch.float32)}
    placements = build_placement(m.load_weights, last_wins, ckpt)
    assert placements["bias"].segments[0].target == "experts.bias"
    assert check_map(m.load_weights, named, placements, ckpt) == {}
