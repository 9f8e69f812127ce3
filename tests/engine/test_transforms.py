"""Post-load transforms (issue 10 item 2): every branch on the synthetic vLLM-shaped model.

Why these modules: a swap-halves step is what FlashInfer-CUTLASS MoE does to w13 (a
permutation: deltas must go through it), a derived tensor is what MLA's `W_UV` is (the step must
re-run after a delta touches its source), and a step whose second run differs is what neither
can serve (the engine must refuse to start, naming the module). Each case applies a real delta
and compares with an independent reference: a fresh rank that loaded the new checkpoint, with
each step then called once directly (`direct`), as after any load, so `observing` builds none of
what it is checked against. Every case runs through `observing`, the wrapper engine start puts
around vLLM's own post-load loop (emulated by `harness.synthetic.vllm_loop`, which calls each quant
method's step the way `model_loader.utils.process_weights_after_loading` does).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from harness.dispatch_log import OpLog
from harness.synthetic import device_check, same_bits, vllm_loop

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.transforms import (
    OffsetMap,
    UnsupportedTransform,
    offset_maps,
    transformed,
)

DC = device_check()
CFG = DC.SIZES["tiny"]
META = {n: (s, torch.bfloat16) for n, s in DC.checkpoint_shapes(CFG).items()}
MOE = f"model.layers.{CFG.layers - 1}.mlp.experts"
ATTN = "model.layers.0.self_attn"


class SwapW13Halves:
    """FlashInfer-CUTLASS-like: w13 = [w1; w3] becomes [w3; w1] per expert."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.w13_weight.data
        n = w.shape[1] // 2
        layer.w13_weight.data = torch.cat([w[:, n:], w[:, :n]], dim=1).contiguous()


class DeriveWUV:
    """MLA-like: a float32 tensor derived from a child's weight, kept on the attention module."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.W_UV = layer.qkv_proj.weight.detach().float().t().contiguous() * 2


class NotReproducible:
    """A step whose re-run differs from its first run (it counts its calls)."""

    calls = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        NotReproducible.calls += 1
        layer.scale = torch.tensor(float(NotReproducible.calls))


class PackedCopy:
    """CPU-kernel-like: the step hides a packed copy of the weight in a closure (no tensor changes)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = layer.qkv_proj.weight.detach().clone()
        layer.packed_weight = lambda: packed


POST_LOAD = pytest.mark.parametrize("post_load", [vllm_loop], ids=["observing"])


def model_with_steps(checkpoint: dict[str, torch.Tensor], steps: dict[str, object]) -> torch.nn.Module:
    """A rank loaded with `checkpoint`, the given post-load steps attached and run under observation."""
    m = DC.SyntheticLM(CFG)
    m.load_weights(checkpoint.items())
    for name, method in steps.items():
        m.get_submodule(name).quant_method = method
    return m


def direct(checkpoint: dict[str, torch.Tensor], steps: dict[str, object]) -> torch.nn.Module:
    """The reference: a direct load of `checkpoint`, then each step called once on its module (no
    observation)."""
    m = DC.SyntheticLM(CFG)
    m.load_weights(checkpoint.items())
    for name, method in steps.items():
        method.process_weights_after_loading(m.get_submodule(name))
    return m


def apply(model: torch.nn.Module, tmp_path, base, new) -> DeltaApplier:
    DC.write_delta(tmp_path / "d", base, new, version=1)
    applier = DeltaApplier(model, META)
    staged = applier.prepare(tmp_path / "d", version=1, base_version=0, current_version=0)
    check_partials([{"rank": 0, "digests": staged.digests, "expected": staged.expected}])
    applier.commit(staged)
    return applier


@POST_LOAD
def test_swap_halves_is_a_permutation_and_deltas_go_through_it(tmp_path, post_load):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    model = model_with_steps(base, {MOE: SwapW13Halves()})
    assert post_load(model) == {MOE: "permutation"}
    applier = apply(model, tmp_path, base, new)
    want = direct(new, {MOE: SwapW13Halves()})
    assert same_bits(want, model) == []
    assert applier.placement_status()["transformed"] == [MOE]
    # The full verify reads the loaded layout back through the same map.
    name = f"{MOE.removesuffix('.experts')}.experts.0.gate_proj.weight"
    assert torch.equal(applier.rebuild(name).view(torch.int16), new[name].view(torch.int16))


@POST_LOAD
def test_derived_tensor_is_rerun_after_its_source_changes(tmp_path, post_load):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    model = model_with_steps(base, {ATTN: DeriveWUV()})
    assert post_load(model) == {ATTN: "rerun"}
    assert model.get_submodule(ATTN)._delta_transform.derived == ["W_UV"]
    stale = model.get_submodule(ATTN).W_UV.clone()
    apply(model, tmp_path, base, new)
    want = direct(new, {ATTN: DeriveWUV()})
    assert same_bits(want, model) == []
    got = model.get_submodule(ATTN).W_UV
    assert not torch.equal(got, stale) and torch.equal(got, want.get_submodule(ATTN).W_UV)
    assert transformed(model) == {ATTN: "rerun"}


@POST_LOAD
def test_swap_and_derived_together(tmp_path, post_load):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    steps = lambda: {MOE: SwapW13Halves(), ATTN: DeriveWUV()}  # noqa: E731
    model = model_with_steps(base, steps())
    assert post_load(model) == {MOE: "permutation", ATTN: "rerun"}
    apply(model, tmp_path, base, new)
    want = direct(new, steps())
    assert same_bits(want, model) == []
    assert torch.equal(model.get_submodule(ATTN).W_UV, want.get_submodule(ATTN).W_UV)


@POST_LOAD
def test_a_step_that_cannot_be_served_refuses_and_names_the_module(post_load):
    model = model_with_steps(DC.random_checkpoint(CFG, "cpu", seed=0), {ATTN: NotReproducible()})
    with pytest.raises(UnsupportedTransform, match=ATTN):
        post_load(model)


@POST_LOAD
def test_hidden_kernel_state_is_rerun_but_not_reported(tmp_path, post_load):
    """A step that keeps a packed copy where no tensor comparison sees it (oneDNN / sgl on CPU)."""
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    model = model_with_steps(base, {ATTN: PackedCopy()})
    assert post_load(model) == {ATTN: "rerun"}
    applier = apply(model, tmp_path, base, new)
    want = direct(new, {})
    assert same_bits(want, model) == []
    packed = model.get_submodule(ATTN).packed_weight()  # re-run from the delta'd weight
    assert torch.equal(packed.view(torch.int16), want.get_submodule(ATTN).qkv_proj.weight.view(torch.int16))
    assert not torch.equal(packed, direct(base, {}).get_submodule(ATTN).qkv_proj.weight)
    assert applier.placement_status()["transformed"] == []


@POST_LOAD
def test_a_step_that_changes_nothing_is_not_a_transform(post_load):
    class Identity:
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.w13_weight.data = layer.w13_weight.data.clone()

    model = model_with_steps(DC.random_checkpoint(CFG, "cpu", seed=0), {MOE: Identity()})
    assert post_load(model) == {}


# ---- permutation maps: per row where whole rows move (issue 17 item 4), else per element ----


class ReorderW13Rows:
    """TRT-LLM-like: gate and up rows interleaved per expert ([g0, u0, g1, u1, ...]), whole rows moved."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.w13_weight.data
        n = w.shape[1] // 2
        layer.w13_weight.data = torch.stack([w[:, :n], w[:, n:]], dim=2).reshape(w.shape).contiguous()


class SwapW13Columns:
    """A permutation inside rows (columns 1 and 2 swapped; each row still starts at its first element):
    no row map, one entry per element."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.w13_weight.data
        order = torch.arange(w.shape[-1])
        order[1], order[2] = 2, 1
        layer.w13_weight.data = w[..., order].contiguous()


W13 = f"{MOE}.w13_weight"
E, ROWS, COLS = DC.SyntheticLM(CFG).get_parameter(W13).shape
PERMUTATIONS = {
    "swap_halves": (SwapW13Halves, COLS),
    "reorder_rows": (ReorderW13Rows, COLS),
    "swap_columns": (SwapW13Columns, 1),
}


def moved(step) -> torch.Tensor:
    """Per element, where `step` puts each loaded element of w13 (built here from element ids, not by the
    classifier): the per-element inverse map."""
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(
        torch.arange(E * ROWS * COLS, dtype=torch.float64).view(E, ROWS, COLS), requires_grad=False
    )
    step().process_weights_after_loading(layer)
    perm = layer.w13_weight.detach().reshape(-1).long()
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return inverse


@POST_LOAD
@pytest.mark.parametrize("kind", PERMUTATIONS)
def test_permutation_maps_are_per_row_where_rows_move_and_both_forms_agree(tmp_path, post_load, kind):
    step, row_len = PERMUTATIONS[kind]
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    model = model_with_steps(base, {MOE: step()})
    assert post_load(model) == {MOE: "permutation"}
    found = offset_maps(model)[W13]
    # Counted: 4 B a row (O(rows)) where whole rows move, 4 B an element otherwise.
    assert found.row_len == row_len and found.table.nbytes == 4 * E * ROWS * COLS // row_len
    per_element = OffsetMap(found.start, moved(step).to(torch.int32))
    every = torch.arange(E * ROWS * COLS) + found.start
    assert torch.equal(found.live(every), per_element.live(every))
    flat = torch.randn(found.start + E * ROWS * COLS + 3)
    assert torch.equal(found.loaded(flat), per_element.loaded(flat))

    # A delta through the found map and through the per-element one: both equal a direct load.
    other = model_with_steps(base, {MOE: step()})
    post_load(other)
    applier = apply(model, tmp_path / "found", base, new)
    DC.write_delta(tmp_path / "d", base, new, version=1)
    reference = DeltaApplier(other, META)
    reference.routing.offset_maps[W13] = per_element
    reference.commit(reference.prepare(tmp_path / "d", version=1, base_version=0, current_version=0))
    want = direct(new, {MOE: step()})
    assert same_bits(want, model) == [] and same_bits(want, other) == []
    name = f"{MOE}.0.up_proj.weight"
    assert torch.equal(applier.rebuild(name).view(torch.int16), new[name].view(torch.int16))


def test_row_map_maps_on_meta_without_host_sync():
    """A 2**31-row map (a 355B MoE's w13 is far smaller) on `meta`: a fixed handful of ops, none to the
    host."""
    rows, row_len = 1 << 31, 7168
    big = OffsetMap(1 << 20, torch.empty(rows, dtype=torch.int64, device="meta"), row_len)
    small = OffsetMap(0, torch.empty(64, dtype=torch.int32, device="meta"), 16)
    offsets = torch.empty(1000, dtype=torch.int64, device="meta")
    flat = torch.empty(4096, dtype=torch.bfloat16, device="meta")
    with OpLog() as mapped:
        out = big.live(offsets)
    with OpLog() as rebuilt:
        small.loaded(flat)
    assert out.device.type == "meta" and out.dtype == torch.int64 and out.shape == (1000,)
    for log in (mapped, rebuilt):
        assert all(op.devices() == {"meta"} for op in log.ops), [op.name for op in log.ops]
        assert log.host_reads() == [] and log.named("nonzero") == []
        assert len(log.ops) <= 9, [op.name for op in log.ops]


class _NoExpertsStep:
    """The experts of a GPU kernel whose own post-load step is a no-op (FlashInfer-CUTLASS's)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass


def flashinfer_cutlass_method():
    """vLLM's own `UnquantizedFusedMoEMethod` with the FlashInfer-CUTLASS backend, its step run as vLLM runs
    it (conversion: `swap_w13_to_w31`; a second call copies into the existing storage and skips the experts'
    step). Only building the kernel is stubbed: flashinfer is not installed here."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    torch.nn.Module.__init__(method)  # its base is a Module (vLLM's CustomOp); its config is not needed here
    method.unquantized_backend, method.moe_kernel = UnquantizedMoeBackend.FLASHINFER_CUTLASS, None
    method._init_moe_kernel = lambda layer: setattr(
        method, "moe_kernel", SimpleNamespace(fused_experts=_NoExpertsStep())
    )
    return method


def with_moe_config(model: torch.nn.Module) -> torch.nn.Module:
    model.get_submodule(MOE).moe_config = SimpleNamespace(is_act_and_mul=True)
    return model


@POST_LOAD
def test_vllm_flashinfer_cutlass_w13_swap_is_a_row_permutation(tmp_path, post_load):
    """Why 3: the re-run must include the method's conversion, or the swap is neither mapped nor
    reproducible."""
    pytest.importorskip("vllm")
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = DC.step(base, 0.3, seed=1)
    model = with_moe_config(model_with_steps(base, {MOE: flashinfer_cutlass_method()}))
    w13 = model.get_parameter(W13)
    assert post_load(model) == {MOE: "permutation"}
    assert model.get_parameter(W13) is w13  # the probe and re-run left the loaded Parameter in place
    found = offset_maps(model)[W13]
    assert found.row_len == COLS and found.table.nbytes == 4 * E * ROWS
    apply(model, tmp_path, base, new)
    want = direct(new, {})  # the reference: a load, then FlashInfer-CUTLASS's [w1; w3] -> [w3; w1] by hand
    half = ROWS // 2
    ref = want.get_parameter(W13).data
    ref.copy_(torch.cat([ref[:, half:], ref[:, :half]], dim=1))
    assert same_bits(want, model) == []
