"""Each parallel dimension's replica rule, in-process: `megatron_hook.hf_map.chunk_segments` run for
every rank of a topology with that rank's explicit coordinates (`Parallel`, mbridge's
`ParallelStates`) over a chunk holding that rank's megatron tensors (harness/megatron_stub.py).

Across the ranks, each element of each HF tensor must be shipped by exactly one rank, every HF
tensor must be shipped, and the ranks that ship are the ones the rule names:
- TP: a split param by every TP rank (its own part), a replicated one (norms, router) by TP rank 0;
- DP: DP rank 0 only (the other replicas hold the same values);
- PP: each stage its own layers (embedding on the first, final norm and lm_head on the last);
- EP: each EP rank its own experts (local expert ids mapped to global ones), the dense params by
  DP rank 0 (EP ranks are data-parallel replicas of the dense params);
- expert-DP: expert-DP rank 0 only, also where expert TP is 1 under TP=2 (experts replicated
  across the TP ranks, deduplicated by their expert-DP rank)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from harness.megatron_stub import ParamSpec, make_bridge, stub_chunk  # noqa: E402

pytestmark = [pytest.mark.megatron]

H, Q, KV, F, MF, E, V, D = 128, 128, 64, 256, 64, 4, 512, 32  # the tiny families (harness/tiny_models.py)


def _attention(i: int, tp: int) -> ParamSpec:
    return {
        f"decoder.layers.{i}.input_layernorm.weight": ((H,), None),
        f"decoder.layers.{i}.self_attention.linear_qkv.weight": (((Q + 2 * KV) // tp, H), 0),
        f"decoder.layers.{i}.self_attention.linear_proj.weight": ((H, Q // tp), 1),
        f"decoder.layers.{i}.pre_mlp_layernorm.weight": ((H,), None),
    }


def _llama_layer(i: int, tp: int) -> ParamSpec:
    return {
        **_attention(i, tp),
        f"decoder.layers.{i}.mlp.linear_fc1.weight": ((2 * F // tp, H), 0),
        f"decoder.layers.{i}.mlp.linear_fc2.weight": ((H, F // tp), 1),
    }


def _moe_layer(i: int, tp: int, etp: int, experts: int) -> ParamSpec:
    """A Qwen3-MoE layer holding `experts` local experts, each cut over `etp` expert-TP ranks."""
    out = {
        **_attention(i, tp),
        f"decoder.layers.{i}.self_attention.q_layernorm.weight": ((D,), None),
        f"decoder.layers.{i}.self_attention.k_layernorm.weight": ((D,), None),
        f"decoder.layers.{i}.mlp.router.weight": ((E, H), None),
    }
    for e in range(experts):
        out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = ((2 * MF // etp, H), 0)
        out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = ((H, MF // etp), 1)
    return out


def _ends(tp: int, first: bool, last: bool) -> ParamSpec:
    out: ParamSpec = {}
    if first:
        out["embedding.word_embeddings.weight"] = ((V // tp, H), 0)
    if last:
        out["decoder.final_layernorm.weight"] = ((H,), None)
        out["output_layer.weight"] = ((V // tp, H), 0)
    return out


@dataclass(frozen=True)
class Rank:
    """One rank's coordinates, as megatron's parallel_state would give them."""

    tp: int = 0
    dp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0


@dataclass(frozen=True)
class Topology:
    family: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    def chunk(self, r: Rank) -> torch.nn.Module:
        layers = 2 // self.pp  # the tiny models have 2 layers
        numbers = [r.pp * layers + k + 1 for k in range(layers)]
        spec = _ends(self.tp, r.pp == 0, r.pp == self.pp - 1)
        for k in range(layers):
            spec.update(
                _llama_layer(k, self.tp)
                if self.family == "llama"
                else _moe_layer(k, self.tp, self.etp, E // self.ep)
            )
        return stub_chunk(spec, numbers)

    def shipped(self, r: Rank) -> dict[str, list[torch.Tensor]]:
        """HF name -> the HF flat positions this rank ships, per segment."""
        from megatron_hook.hf_map import Parallel, chunk_segments

        parallel = dict(
            tp_size=self.tp, tp_rank=r.tp, pp_size=self.pp, pp_rank=r.pp, etp_size=self.etp, etp_rank=r.etp
        )
        if self.ep > 1:
            parallel.update(ep_size=self.ep, ep_rank=r.ep)
        bridge = make_bridge(self.family, **parallel)
        out: dict[str, list[torch.Tensor]] = {}
        for s in chunk_segments(bridge, self.chunk(r), Parallel(r.tp, self.tp, r.etp, self.etp, r.dp, r.edp)):
            out.setdefault(s.name, []).append(s.global_index())
        return out


@functools.cache
def _everything(family: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor, shipped by the one rank of TP=PP=EP=DP=1."""
    from megatron_hook.hf_map import Parallel, chunk_segments

    t = Topology(family)
    return {
        s.name: s.full_shape
        for s in chunk_segments(make_bridge(family), t.chunk(Rank()), Parallel(0, 1, 0, 1, 0, 0))
    }


def _check_exactly_once(family: str, by_rank: dict[Rank, dict[str, list[torch.Tensor]]]) -> None:
    everything = _everything(family)
    names = {n for shipped in by_rank.values() for n in shipped}
    assert names == set(everything), names ^ set(everything)
    for name, shape in everything.items():
        pos = torch.cat([p for shipped in by_rank.values() for p in shipped.get(name, [])])
        assert torch.equal(pos.sort().values, torch.arange(math.prod(shape))), (
            f"{name}: not each element once"
        )


def _ships(shipped: dict[str, list[torch.Tensor]], name: str) -> int:
    return sum(p.numel() for p in shipped.get(name, []))


NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm", "q_norm", "k_norm", "mlp.gate.weight")


def test_tp_split_params_by_every_rank_replicated_by_rank_0() -> None:
    t = Topology("llama", tp=2, etp=2)
    by_rank = {r: t.shipped(r) for r in (Rank(tp=0, etp=0), Rank(tp=1, etp=1))}
    _check_exactly_once("llama", by_rank)
    r0, r1 = by_rank.values()
    assert not any(any(k in n for k in NORMS) for n in r1)
    assert all(_ships(r0, n) == _ships(r1, n) for n in r1)  # an even TP split
    assert "model.layers.0.input_layernorm.weight" in r0 and "model.layers.1.self_attn.q_proj.weight" in r1


def test_dp_only_rank_0_ships() -> None:
    t = Topology("llama", tp=2, etp=2)
    ranks = [Rank(tp=tp, etp=tp, dp=dp) for dp in (0, 1) for tp in (0, 1)]
    by_rank = {r: t.shipped(r) for r in ranks}
    _check_exactly_once("llama", by_rank)
    assert [bool(by_rank[r]) for r in ranks] == [True, True, False, False]


def test_pp_each_stage_its_own_layers() -> None:
    t = Topology("llama", pp=2)
    first, last = Rank(pp=0), Rank(pp=1)
    by_rank = {first: t.shipped(first), last: t.shipped(last)}
    _check_exactly_once("llama", by_rank)
    assert {n.split(".")[2] if n.startswith("model.layers.") else n for n in by_rank[first]} == {
        "0",
        "model.embed_tokens.weight",
    }
    assert {n.split(".")[2] if n.startswith("model.layers.") else n for n in by_rank[last]} == {
        "1",
        "model.norm.weight",
        "lm_head.weight",
    }


def _experts(shipped: dict[str, list[torch.Tensor]]) -> set[tuple[str, str]]:
    """(layer, global expert id) of every expert tensor shipped."""
    return {(n.split(".")[2], n.split(".")[5]) for n in shipped if ".mlp.experts." in n}


def test_ep_each_rank_its_experts_dense_by_dp_rank_0() -> None:
    t = Topology("qwen3_moe", ep=2)
    ranks = [Rank(ep=0, dp=0), Rank(ep=1, dp=1)]  # world 2 = EP 2: the dense params have DP 2
    by_rank = {r: t.shipped(r) for r in ranks}
    _check_exactly_once("qwen3_moe", by_rank)
    assert _experts(by_rank[ranks[0]]) == {(i, e) for i in "01" for e in "01"}
    assert _experts(by_rank[ranks[1]]) == {(i, e) for i in "01" for e in "23"}
    assert all(".mlp.experts." in n for n in by_rank[ranks[1]])


def test_expert_dp_only_rank_0_ships_experts() -> None:
    t = Topology("qwen3_moe", ep=2)
    ranks = [Rank(ep=r % 2, edp=r // 2, dp=r) for r in range(4)]  # world 4 = EP 2 x expert-DP 2
    by_rank = {r: t.shipped(r) for r in ranks}
    _check_exactly_once("qwen3_moe", by_rank)
    assert [bool(by_rank[r]) for r in ranks] == [True, True, False, False]
    assert _experts(by_rank[ranks[1]]) == {(i, e) for i in "01" for e in "23"}


@pytest.mark.parametrize("etp", [2, 1])
def test_experts_under_tp2_split_by_expert_tp_or_deduplicated_by_expert_dp(etp: int) -> None:
    """TP=2 with expert TP 2 (each expert cut in two) or expert TP 1 (each TP rank holds every
    expert whole: megatron makes them expert-DP replicas, rank 1 of which ships nothing)."""
    t = Topology("qwen3_moe", tp=2, etp=etp)
    ranks = [Rank(tp=tp, etp=tp if etp == 2 else 0, edp=0 if etp == 2 else tp) for tp in (0, 1)]
    by_rank = {r: t.shipped(r) for r in ranks}
    _check_exactly_once("qwen3_moe", by_rank)
    every = {(i, str(e)) for i in "01" for e in range(E)}
    assert _experts(by_rank[ranks[0]]) == every
    assert _experts(by_rank[ranks[1]]) == (every if etp == 2 else set())
    assert not any(k in n for k in NORMS for n in by_rank[ranks[1]])  # norms, q/k norms, router: TP rank 0
