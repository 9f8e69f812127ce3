"""A "rerun" unit's re-run (`derived.Unit.rederive`) on vLLM's real CPU linear layers (the oneDNN
repack) and on a step that writes into its input.

Why: on an x86 CPU with AMX, vLLM's post-load step for an unquantized linear layer hands the
weight to oneDNN (`create_onednn_mm`), which serves from its own packed copy, and empties
`layer.weight`. A delta written into the checkpoint-layout tensor reaches that kernel only
through a refresh; these tests establish, on the Llama's shapes, what the refresh relies on
and what makes it cheap: the handler copies the weight (later writes to the canonical tensor
never leak into the served kernel, so a refresh is needed and sufficient), vLLM's step leaves
its input untouched, and a refresh then computes bit for bit like a layer freshly built from
the same weights, with no tensor copied by us (counted). The last test shows why the generic
path still clones a stashed tensor before re-running a step: vLLM's steps may write into the
parameter they are given (`layer.w13_weight.data.copy_(...)` in the unquantized fused MoE).
"""

from __future__ import annotations

import weakref
from collections import deque

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_delta.engine import commit, derived, transforms
from vllm_delta.engine.staging import Chunk, StagedUpdate

pytest.importorskip("vllm")
from vllm import _custom_ops as ops  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

# benchmarks/apply.py's 0.5 B Llama: hidden 1024, 16 heads of 64, 8 KV heads, intermediate 4096.
SHAPES = {
    "qkv_proj": (2048, 1024),
    "o_proj": (1024, 1024),
    "gate_up_proj": (8192, 1024),
    "down_proj": (1024, 4096),
}


class Linear(nn.Module):
    """A vLLM unquantized linear layer as the model holds it: a weight and vLLM's own method."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in SHAPES.items()}


def started(w: dict[str, torch.Tensor]) -> nn.ModuleDict:
    """Engine start with delta updates on: each step observed and classified inside vLLM's loop."""
    model = nn.ModuleDict({k: Linear(t) for k, t in w.items()})
    with transforms.observing(model):
        for m in model.values():
            m.quant_method.process_weights_after_loading(m)
    return model


def rerun(modules) -> None:
    """What a commit does for each touched "rerun" module no stand-in could build: its step re-run."""
    for m in modules:
        transforms.rerun_unit(m).rederive()


def fresh(w: dict[str, torch.Tensor]) -> nn.ModuleDict:
    """The reference: layers built from `w` by vLLM's step alone (no transforms)."""
    model = nn.ModuleDict({k: Linear(t) for k, t in w.items()})
    for m in model.values():
        m.quant_method.process_weights_after_loading(m)
    return model


def outputs(model: nn.ModuleDict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: m(torch.randn(3, SHAPES[k][1], generator=gen).to(torch.bfloat16)) for k, m in model.items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))]


def delta(model: nn.ModuleDict, new: dict[str, torch.Tensor], seed: int) -> None:
    """Step 2% of each weight by one ULP in `new` (the trainer's new checkpoint) and write those
    values in place into the tensors deltas target, at flat offsets, as a commit does."""
    targets = {n: canon for n, (_, canon) in transforms.canonical_tensors(model).items()}
    gen = torch.Generator().manual_seed(seed)
    for k, values in new.items():
        bits = values.view(-1).view(torch.int16)
        at = torch.randint(bits.numel(), (bits.numel() // 50,), generator=gen)
        bits[at] += 1
        targets[f"{k}.weight"].view(-1)[at] = values.view(-1)[at]


def _dispatches_to_onednn() -> bool:
    """Whether vLLM's CPU linear step packs these shapes with oneDNN here (AMX hosts; not zentorch or sgl)."""
    calls = []
    create = ops.create_onednn_mm
    ops.create_onednn_mm = lambda *a, **k: calls.append(1) or create(*a, **k)
    try:
        layer = Linear(torch.zeros(1024, 1024, dtype=torch.bfloat16))
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        ops.create_onednn_mm = create
    return bool(calls)


onednn = pytest.mark.skipif(
    not _dispatches_to_onednn(), reason="vLLM's CPU linear does not use oneDNN on this host"
)


@onednn
def test_a_refreshed_linear_computes_like_a_fresh_one_and_only_after_the_refresh():
    w0 = weights(0)
    model = started(w0)
    assert {k: getattr(m, transforms.TRANSFORM_ATTR).kind for k, m in model.items()} == dict.fromkeys(
        SHAPES, "rerun"
    )
    pointers = {k: m.weight.data_ptr() for k, m in model.items()}
    served0 = outputs(fresh(w0))
    assert differing(outputs(model), served0) == []

    w1 = {k: t.clone() for k, t in w0.items()}
    delta(model, w1, seed=1)
    # oneDNN serves from its own packed copy: the write has not reached the kernel.
    assert differing(outputs(model), served0) == []
    rerun(model.values())
    served1 = outputs(fresh(w1))
    assert differing(served1, served0) == list(SHAPES)  # the delta does change every layer's output
    assert differing(outputs(model), served1) == []
    # vLLM's step read the canonical tensor and wrote nothing into it; it is the live weight again.
    assert all(torch.equal(m.weight.view(torch.int16), w1[k].view(torch.int16)) for k, m in model.items())
    assert {k: m.weight.data_ptr() for k, m in model.items()} == pointers

    # The handler keeps no pointer to the canonical tensor: the next delta's writes stay out of
    # the served kernel until its refresh, and then the kernel computes from them.
    w2 = {k: t.clone() for k, t in w1.items()}
    delta(model, w2, seed=2)
    assert differing(outputs(model), served1) == []
    rerun(model.values())
    assert differing(outputs(model), outputs(fresh(w2))) == []
    assert {k: m.weight.data_ptr() for k, m in model.items()} == pointers


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@onednn
def test_refreshing_a_linear_packs_once_and_copies_nothing(monkeypatch):
    """The refresh of a oneDNN linear is vLLM's repack alone: one handler built (the old one
    released), no tensor cloned or copied by the bookkeeping around it."""
    model = started(weights(0))
    built: list[torch.Tensor] = []
    create = ops.create_onednn_mm

    def counted(weight: torch.Tensor, *args, **kwargs):
        built.append(weight)
        return create(weight, *args, **kwargs)

    monkeypatch.setattr(ops, "create_onednn_mm", counted)
    with OpCount() as count:
        rerun(model.values())
    assert len(built) == len(SHAPES)
    assert {w.data_ptr() for w in built} == {
        m.weight.data_ptr() for m in model.values()
    }  # from the canonical tensor
    assert count.ops.count("release_dnnl_matmul_handler.default") == len(SHAPES)
    moved = [
        op for op in count.ops if op.split(".")[0] in {"clone", "copy_", "copy", "_to_copy", "index_put_"}
    ]
    assert moved == []


class InPlace(QuantizeMethodBase):
    """A step that converts its weight in place, as vLLM's unquantized fused MoE does
    (`layer.w13_weight.data.copy_(...)`), then keeps a derived kernel copy."""

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data.mul_(2)
        layer.kernel = layer.weight.data.t().contiguous()


class Stepped(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.quant_method = InPlace()


def test_a_step_that_writes_into_its_input_runs_on_a_copy_of_the_canonical_tensor():
    """Why the generic path clones a stashed tensor before the step: without it the step's
    in-place write lands in the canonical tensor, and the next refresh converts it twice."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=gen).to(torch.bfloat16)
    model = nn.ModuleDict({"m": Stepped(w)})
    with transforms.observing(model):
        model["m"].quant_method.process_weights_after_loading(model["m"])
    m = model["m"]
    assert getattr(m, transforms.TRANSFORM_ATTR).kind == "rerun"
    canon = transforms.rerun_unit(m).canonical["weight"]
    for step in range(1, 3):
        canon[step % 8, 0] = float(step)
        w[step % 8, 0] = float(step)
        rerun([m])
        assert torch.equal(canon, w)
        assert torch.equal(m.weight.data, w * 2) and torch.equal(m.kernel, (w * 2).t())


def _staged_delta(model: nn.ModuleDict, new: dict[str, torch.Tensor], seed: int) -> StagedUpdate:
    """`delta`'s 2% one-ULP steps as a prepare stages them (flat offsets and new values per weight), in
    `new` and not yet in the model."""
    targets = {n: canon for n, (_, canon) in transforms.canonical_tensors(model).items()}
    gen = torch.Generator().manual_seed(seed)
    writes = {}
    for k, values in new.items():
        bits = values.view(-1).view(torch.int16)
        at = torch.randint(bits.numel(), (bits.numel() // 50,), generator=gen).unique()
        bits[at] += 1
        target = targets[f"{k}.weight"]
        writes[f"{k}.weight"] = deque(
            [Chunk((at + target.storage_offset()).to(torch.int32), values.view(-1)[at])]
        )
    return StagedUpdate(
        version=1,
        writes=writes,
        fallback=[],
        total_changed=0,
        changed=0,
        bytes_read=0,
        decode_s=0.0,
        replay=False,
    )


@onednn
def test_the_repack_is_built_in_prepare_and_only_swapped_in_at_commit(monkeypatch):
    """Prepare builds each touched linear's new oneDNN handler from a copy of its new weights: the live
    weights and handlers are untouched until the commit, which builds nothing (it swaps handlers), and
    then computes like a layer freshly built from the new weights. A prepare dropped (failed or
    aborted) leaves the layers serving the old weights. Each unit's written copy is freed before the
    next unit's is made (at 2% on benchmarks/apply.py's Llama all of them held at once were ~1 GB): the
    handler keeps its own packed copy, so what the freed memory then holds changes nothing served."""
    w0 = weights(0)
    model = started(w0)
    served0 = outputs(fresh(w0))
    handlers = {k: m.cpu_linear for k, m in model.items()}
    before = {k: m.weight.clone() for k, m in model.items()}
    w1 = {k: t.clone() for k, t in w0.items()}
    staged = _staged_delta(model, w1, seed=1)
    targets = {n: canon for n, (_, canon) in transforms.canonical_tensors(model).items()}
    copies: list[weakref.ref] = []
    alive_at_each_unit = []
    prebuild = derived.prebuild

    def counted(model, unit, written):
        alive_at_each_unit.append(sum(ref() is not None for ref in copies))
        copies.extend(weakref.ref(t) for t in written.values())
        return prebuild(model, unit, written)

    monkeypatch.setattr(derived, "prebuild", counted)
    staged.prebuilt = commit.prebuild_touched(model, targets, staged.writes)
    assert alive_at_each_unit == [0] * len(SHAPES) and all(ref() is None for ref in copies)
    junk = [torch.full_like(t, float("nan")) for t in w1.values()]  # likely in the copies' freed memory
    assert sorted(n for n, _ in staged.prebuilt.built) == sorted(SHAPES)
    assert {k: m.cpu_linear for k, m in model.items()} == handlers
    assert all(torch.equal(m.weight.view(torch.int16), before[k].view(torch.int16)) for k, m in model.items())
    assert differing(outputs(model), served0) == []

    dropped = _staged_delta(model, {k: t.clone() for k, t in w0.items()}, seed=2)
    dropped.prebuilt = commit.prebuild_touched(model, targets, dropped.writes)
    del dropped  # a prepare that fails after staging, or one the door aborts
    assert differing(outputs(model), served0) == []

    built = []
    create = ops.create_onednn_mm
    monkeypatch.setattr(ops, "create_onednn_mm", lambda *a, **k: built.append(1) or create(*a, **k))
    commit.commit(model, targets, staged)
    assert built == [] and "post_load" in staged.times.seconds
    assert differing(outputs(model), outputs(fresh(w1))) == []
    assert all(torch.equal(m.weight.view(torch.int16), w1[k].view(torch.int16)) for k, m in model.items())
    del junk


class LMHead(Linear):
    """vLLM's untied LM head as the model holds it: its step packs the weight and keeps it (the
    embedding method's `remove_weight=False`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        self.quant_method = UnquantizedEmbeddingMethod()


@onednn
def test_the_lm_heads_repack_is_built_in_prepare_too(monkeypatch):
    """The LM head's packed copy is built in prepare from a written copy of its live weight (which the
    step keeps, so nothing is restored), and the commit only swaps it in: before, it was re-run in the
    pause (0.45 s of a 0.82 s pause in benchmarks/sender.py's 0.5 B Llama)."""
    w0 = {"lm_head": torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    model = nn.ModuleDict({"lm_head": LMHead(w0["lm_head"])})
    with transforms.observing(model):
        model["lm_head"].quant_method.process_weights_after_loading(model["lm_head"])
    assert transforms.rerun_unit(model["lm_head"]) is not None
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    served0 = model["lm_head"](x)
    w1 = {"lm_head": w0["lm_head"].clone()}
    staged = _staged_delta(model, w1, seed=1)
    targets = {n: canon for n, (_, canon) in transforms.canonical_tensors(model).items()}
    staged.prebuilt = commit.prebuild_touched(model, targets, staged.writes)
    assert sorted(n for n, _ in staged.prebuilt.built) == ["lm_head"]
    assert torch.equal(model["lm_head"](x), served0)  # prepare changed nothing served

    built = []
    create = ops.create_onednn_mm
    monkeypatch.setattr(ops, "create_onednn_mm", lambda *a, **k: built.append(1) or create(*a, **k))
    commit.commit(model, targets, staged)
    assert built == []
    monkeypatch.undo()
    reference = LMHead(w1["lm_head"])
    reference.quant_method.process_weights_after_loading(reference)
    assert torch.equal(model["lm_head"](x).view(torch.int16), reference(x).view(torch.int16))
    assert torch.equal(model["lm_head"].weight.view(torch.int16), w1["lm_head"].view(torch.int16))
