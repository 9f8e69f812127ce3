"""MLA's derived tensors on real CPU engines: views, copies re-derived in place, and a refused model-level
step.

Why: vLLM's MLA attention derives `W_UV` / `W_UK_T` from `kv_b_proj` in its own post-load step.
On the CPU MLA backend with a bf16 `kv_b_proj` they are views, but AMX, a quantized `kv_b_proj`
and DCP make them copies; a receiver that does not re-derive them serves prefill from the new
`kv_b_proj` and decode from the old copies while every checkpoint digest matches.

A tiny DeepSeek-V3 (q and kv LoRA, kv_lora_rank 512 + qk_rope_head_dim 64 as the CPU decode
kernel needs; a dense first layer, then MoE with a shared expert and `e_score_correction_bias`)
runs on the CPU_MLA backend with a test-only step (harness/post_load_steps_mla_worker) that makes
layer 0's `W_UV` / `W_UK_T` copies, as AMX does; layer 1 keeps vLLM's views. Updates of each kind
(base-relative `ulp_zstd`, a full anchor, overwrite `deltas`), each rewriting every `kv_b_proj`, run
on two engines: one from BASE up to FINAL, one from FINAL down to BASE (an anchor) and back up. Each
state reached must equal the other engine's fresh load of it, bit for bit, in vLLM's per-parameter
digests and in every derived tensor; the engine brought back to FINAL must serve its own fresh
load's greedy tokens and logprobs (compared within one engine, after warm-up calls: vLLM's CPU engine
serves this model call-dependently, see WARMUP); every parameter's and derived tensor's
`data_ptr()` stays unchanged. On an AMX host, vLLM's own AMX MLA backend (packed copies on the impl,
`kv_b_proj.weight` emptied) goes through the same.
A model-level step whose derived tensor no re-run reproduces is refused at startup.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.cli_diff import diff
from harness.engine_pool import write_anchor
from harness.perturb import perturb_tensor
from harness.post_load_steps_mla_worker import COPIED, EXTENSION, MODEL_STEP_ENV, MODEL_TENSOR
from harness.tiny_models import VOCAB_SIZE
from harness.vllm_engine import greedy, patched_environ, start_llm
from safetensors.torch import load_file, save_file

from vllm_delta.wire.checkpoint import Checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

BACKEND = {"attention_config": {"backend": "CPU_MLA"}}  # vLLM's reference CPU MLA (AMX would be picked here)
# vLLM's CPU engine serves this model call-dependently: on one engine with unchanged weights, the
# first two greedy calls gave first-token logprob -4.692502 and the third -4.700635 (with and without
# prefix caching). Zeroing every KV cache before each call does not fix it: on BASE one fresh engine's
# first call gave -4.570328 and another's -4.578061, with equal parameter and derived digests.
# Outputs are compared after this many warm-up calls.
WARMUP = 3
LAYER0, LAYER1 = "model.layers.0.self_attn.mla_attn.mla_attn", "model.layers.1.self_attn.mla_attn.mla_attn"


def make_tiny_mla(out: Path) -> Path:
    import harness.megatron_cpu as megatron_cpu
    from harness.megatron_cpu import make_tiny_deepseek_v3
    from transformers import DeepseekV3Config

    def config(layers: int, mtp_layers: int, dense_layers: int) -> DeepseekV3Config:
        cfg = DeepseekV3Config(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=dense_layers,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            q_lora_rank=32,
            kv_lora_rank=512,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            max_position_embeddings=512,
            num_nextn_predict_layers=mtp_layers,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cfg.rope_theta = 10000.0
        cfg.topk_method, cfg.scoring_func = (
            "noaux_tc",
            "sigmoid",
        )  # vLLM loads e_score_correction_bias only then
        return cfg

    stock, megatron_cpu.tiny_deepseek_v3_config = megatron_cpu.tiny_deepseek_v3_config, config
    try:
        return make_tiny_deepseek_v3(out, layers=2, dense_layers=1)
    finally:
        megatron_cpu.tiny_deepseek_v3_config = stock


def train_step(prev: Path, out: Path, seed: int) -> Path:
    """`prev` with 2% of every tensor moved by a few ULPs and every `kv_b_proj` rewritten (100%)."""
    gen = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True)
    for path in prev.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            save_file(
                {n: perturb_tensor(t, 1.0 if "kv_b_proj" in n else 0.02, gen) for n, t in tensors.items()},
                out / path.name,
                metadata={"format": "pt"},
            )
        elif path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """BASE, FINAL, and the updates [(kind, delta, base_version)] up from BASE and down from FINAL."""
    root = tmp_path_factory.mktemp("mla")
    base = make_tiny_mla(root / "base")
    v1 = train_step(base, root / "v1", 1)
    v2 = train_step(v1, root / "v2", 2)
    v3 = train_step(v2, root / "v3", 3)
    up = [
        ("ulp_zstd", diff(base, v1, root / "d1", "ulp_zstd", 1), 0),
        ("anchor", write_anchor(root / "d2", Checkpoint.open(v2).iter_tensors(), 2), None),
        ("deltas", diff(v2, v3, root / "d3", "deltas", 3), 2),
    ]
    # For an engine started on FINAL: an anchor back to BASE, then the same three kinds (versions + 1).
    down = [
        ("anchor", write_anchor(root / "e1", Checkpoint.open(base).iter_tensors(), 1), None),
        ("ulp_zstd", diff(base, v1, root / "e2", "ulp_zstd", 2), 1),
        ("anchor", write_anchor(root / "e3", Checkpoint.open(v2).iter_tensors(), 3), None),
        ("deltas", diff(v2, v3, root / "e4", "deltas", 4), 3),
    ]
    return {"base": base, "final": v3, "up": up, "down": down}


def state(llm) -> dict:
    """What the engine serves from: vLLM's per-parameter digests, every derived tensor's bits, data_ptr()s."""
    return {
        "params": llm.collective_rpc("compute_weight_checksums")[0],
        "derived": llm.collective_rpc("mla_derived_digests")[0],
        "pointers": llm.collective_rpc("mla_pointers")[0],
    }


def verify(llm) -> dict:
    """The worker's full verify: whole-tensor digests and xxh3 of every tensor updates wrote."""
    return llm.collective_rpc("delta_verify")[0]


def run(start: Path, updates: list[tuple[str, Path, int | None]], **backend) -> dict:
    """An engine started on `start`: its fresh load's output and state, then the state after each update."""
    with start_llm(start, delta=True, worker_extension_cls=EXTENSION, **backend) as llm:
        for _ in range(WARMUP):
            greedy(llm)
        out = {
            "found": llm.collective_rpc("mla_discovery")[0],
            "probe": llm.collective_rpc("delta_probe")[0],
            "fresh_out": greedy(llm),
            "states": [state(llm)],
            "prepared": [],
            "commits": [],
        }
        for version, (kind, path, base_version) in enumerate(updates, start=1):
            request = {
                "id": f"v{version}",
                "path": str(path),
                "version": version,
                "base_version": base_version,
                "files": None,
                "max_staged_bytes": 1 << 28,
            }
            if version == len(updates):  # a prepare that fails after building on stand-ins changes nothing
                failed = llm.collective_rpc("mla_prepare_failing", args=(request,))[0]
                out["failed"] = {"reply": failed, "state": state(llm), "verify": verify(llm)}
            prepared = llm.collective_rpc("delta_prepare", args=(request,))[0]
            assert prepared["ok"], (kind, prepared)
            out["prepared"].append({"phases": prepared["phases"], "state": state(llm)})
            committed = llm.collective_rpc("mla_commit_logged", args=(request["id"],))[0]
            assert committed["reply"]["ok"], (kind, committed)
            out["commits"].append({"ops": committed["ops"], "steps": committed["steps"]})
            out["states"].append(state(llm))
            if version == 1:
                out["after_first"] = greedy(llm)
        # vLLM's CPU engine serves this model call-dependently even after the warm-up (a near tie can flip
        # a greedy token between calls with unchanged weights): the check takes any of three calls.
        out["out"] = [greedy(llm) for _ in range(3)]
        out["status"] = llm.collective_rpc("delta_status")[0]
    return out


def engines(chain, **backend) -> tuple[dict, dict]:
    """(up, down): one engine from BASE through the three updates, one from FINAL to BASE and back."""
    return run(chain["base"], chain["up"], **backend), run(chain["final"], chain["down"], **backend)


@pytest.fixture(scope="module")
def cpu_mla(chain) -> tuple[dict, dict]:
    return engines(chain, **BACKEND)


def tokens(out: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    return [t for t, _ in out]


def check_exact(up: dict, down: dict) -> None:
    """Exact on what the engines serve. Outputs are compared within one engine (its fresh load of FINAL,
    after WARMUP calls, against the same engine brought back to FINAL by deltas). Bits are compared
    across engines: every parameter's digest and every derived tensor's, at BASE (the FINAL engine after
    its anchor to BASE vs the BASE engine's fresh load) and at FINAL (the BASE engine after its updates
    vs the FINAL engine's fresh load)."""
    for r in (up, down):
        assert not r["status"]["dirty"] and r["found"]["refused"] == {}, (r["status"], r["found"]["refused"])
    assert down["after_first"] != down["fresh_out"], "the served output must follow the weights"
    # vLLM's CPU MLA engine serves call-dependently (logprobs, and near-tie tokens, move between calls with
    # unchanged weights), so outputs are held to the first greedy token of each prompt; exactness is the
    # bits below (a stale copy shows there: the no-re-derive mutation fails the W_UV / W_UK_T digests).
    firsts = [[t[0] for t in tokens(o)] for o in down["out"]]
    assert [t[0] for t in tokens(down["fresh_out"])] in firsts
    for got, want in ((down["states"][1], up["states"][0]), (up["states"][-1], down["states"][0])):
        for kind in ("params", "derived"):
            assert got[kind].keys() == want[kind].keys()
            assert sorted(n for n in want[kind] if got[kind][n] != want[kind][n]) == [], kind


def test_discovery_classifies_views_and_copies(cpu_mla):
    found, probe = cpu_mla[0]["found"], cpu_mla[0]["probe"]
    kinds = {(unit, key): (kind, sources) for unit, key, kind, sources in found["tensors"]}
    for name in ("param:W_UV", "param:W_UK_T"):
        assert kinds[(LAYER0, name)] == ("rederive", ["model.layers.0.self_attn.kv_b_proj.weight"]), kinds
        assert kinds[(LAYER1, name)] == ("view", ["model.layers.1.self_attn.kv_b_proj.weight"]), kinds
    assert LAYER0.startswith(COPIED)
    # vLLM's default KV-cache scales (1.0) are derived by the same step, from no parameter.
    assert any(
        unit == LAYER1 and key.endswith("_k_scale") and kind == "constant" and not sources
        for unit, key, kind, sources in found["tensors"]
    ), found["tensors"]
    assert found["units"] == {LAYER0: ["model.layers.0.self_attn.kv_b_proj.weight"]}, found["units"]
    assert found["refused"] == {} and probe["refused"] == {}, (found, probe)
    assert LAYER0 in probe["transformed"]


def test_updates_match_fresh_engine(cpu_mla):
    """Greedy tokens, logprobs, every parameter's digest (W_UV / W_UK_T included) and every derived tensor's
    bits equal a fresh load, after base-relative, anchor and overwrite updates that rewrite kv_b_proj."""
    check_exact(*cpu_mla)


def test_pointers_stable_across_updates(cpu_mla):
    """data_ptr() of every parameter and derived tensor is the same after each kind of update."""
    for r in cpu_mla:
        first, *after = [s["pointers"] for s in r["states"]]
        assert any(k.startswith(f"derived:{LAYER0}.") for k in first) and any(
            k.startswith("param:") for k in first
        )
        for i, ptrs in enumerate(after):
            assert ptrs == first, (i, sorted(k for k in first if ptrs.get(k) != first[k]))


def test_rederived_copies_are_built_in_prepare_and_only_copied_at_commit(cpu_mla):
    """Layer 0's W_UV / W_UK_T (copies) are derived in prepare, on a stand-in of the serving attention layer
    (its step ran then, in the `prebuild` phase, and the live tensors were untouched until the commit); the
    commit runs no MLA step and its only ops on those tensors are one `copy_` each (same data_ptr:
    test_pointers_stable_across_updates). Before, the step re-ran inside the pause."""
    for r in cpu_mla:
        assert LAYER0 not in r["status"]["placement"]["in_pause"], r["status"]["placement"]["in_pause"]
        assert len(r["commits"]) == len(r["prepared"]) >= 3
        for before, prepared, commit in zip(r["states"], r["prepared"], r["commits"]):
            assert "prebuild" in prepared["phases"], prepared["phases"]
            assert prepared["state"] == before  # prepared, not yet committed: what serves is unchanged
            assert commit == {"ops": ["copy_", "copy_"], "steps": 0}, commit


def test_failed_prepare_leaves_weights_and_derived_copies_untouched(cpu_mla):
    """A prepare that fails after its stand-ins ran: every parameter's digest, every derived tensor's bits
    and every data_ptr() are as before it, and the full verify is clean."""
    for r in cpu_mla:
        failed = r["failed"]
        assert not failed["reply"]["ok"] and "injected" in str(failed["reply"]), failed["reply"]
        assert failed["state"] == r["states"][-2]
        v = failed["verify"]
        assert v["ok"] and v["hash_mismatched"] == [], v
        assert v["digests"] == v["expected"], sorted(
            n for n in v["expected"] if v["digests"][n] != v["expected"][n]
        )


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="vLLM picks its AMX MLA backend only on AMX hosts"
)
def test_amx_backend_copies_rederived(chain):
    """vLLM's own AMX MLA backend (its default here): VNNI-packed W_UK / W_UV copies on the impl, and
    `kv_b_proj.weight` emptied; the same checks and pointer stability, but greedy tokens without their
    logprobs: vLLM's AMX kernels drift call to call here even after the warm-up (-4.700545 vs -4.708516 on
    one engine with the same weights); the derived tensors' bits are compared exactly."""
    up, down = engines(chain)
    kinds = {(unit, key): (kind, sources) for unit, key, kind, sources in up["found"]["tensors"]}
    for layer, unit in enumerate((LAYER0, LAYER1)):
        for name in ("impl.attr:_w_uk_packed", "impl.attr:_w_uv_packed"):
            assert kinds[(unit, name)] == (
                "rederive",
                [f"model.layers.{layer}.self_attn.kv_b_proj.weight"],
            ), kinds
    check_exact(up, down)
    for r in (up, down):
        assert all(s["pointers"] == r["states"][0]["pointers"] for s in r["states"])


def test_model_level_derived_tensor_refused(chain):
    """A model-level step whose derived tensor a re-run does not reproduce: updates refused at startup,
    named."""
    base = chain["base"]
    with (
        patched_environ({MODEL_STEP_ENV: "1"}),
        start_llm(base, delta=True, worker_extension_cls=EXTENSION, **BACKEND) as llm,
    ):
        found = llm.collective_rpc("mla_discovery")[0]
        probe = llm.collective_rpc("delta_probe")[0]
    assert list(found["refused"]) == [f"attr:{MODEL_TENSOR}"], found["refused"]
    assert "the model" in found["refused"][f"attr:{MODEL_TENSOR}"]
    assert probe["refused"] == found["refused"], probe  # what /health and the status report


class _Impl:
    """Stands in for an attention impl: plain tensor attributes its owner's step sets."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None


class _AmxLikeAttention(torch.nn.Module):
    """Shaped like vLLM's AMX MLA step: packed copies on the impl from `kv_b_proj`, whose weight it
    empties."""

    def __init__(self, fold_into_weight: bool = False) -> None:
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        self.impl, self.fold = _Impl(), fold_into_weight

    def process_weights_after_loading(self) -> None:
        w = self.kv_b_proj.weight
        if self.fold:  # changes a checkpoint parameter in place: no delta could stay exact
            w.data.mul_(2)
            return
        self.impl.packed = w.t().float().contiguous()
        self.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def _observed(module: torch.nn.Module):
    from vllm_delta.engine import derived

    model = torch.nn.Sequential(module)
    with torch.no_grad():
        module.kv_b_proj.weight.copy_(torch.randn(32, 64))
    found = derived.Discovery()
    setattr(model, derived.DISCOVERY_ATTR, found)
    weight = module.kv_b_proj.weight
    derived.Discoverer(model, found).observe("0", module, type(module).process_weights_after_loading)
    return model, found, weight


def test_amx_shaped_step_rederived_in_place():
    """The emptied weight gets its loaded bytes back; after a write, the packed copy is re-derived into
    the storage it had (checked against the weight itself, not against a re-run)."""
    from vllm_delta.engine import derived

    model, found, weight = _observed(_AmxLikeAttention())
    attn = model[0]
    assert attn.kv_b_proj.weight is weight and weight.numel() == 32 * 64
    assert [(t.key, t.kind, t.sources) for t in found.tensors] == [
        ("impl.attr:packed", "rederive", ["0.kv_b_proj.weight"])
    ]
    packed_ptr = attn.impl.packed.data_ptr()
    with torch.no_grad():
        weight.add_(1)
    assert derived.touched(model, ["0.other.weight"]) == []
    (unit,) = derived.touched(model, ["0.kv_b_proj.weight"])
    derived.rederive(unit.module, unit.step)  # what the commit does where no stand-in could run the step
    assert attn.impl.packed.data_ptr() == packed_ptr and attn.kv_b_proj.weight is weight
    assert torch.equal(attn.impl.packed, weight.detach().t().float())


def test_amx_shaped_step_built_on_a_stand_in_then_copied_in_place():
    """In prepare the step runs on a stand-in holding the new weight: the live module (its weight, its impl
    and the packed copy there) is untouched; the commit's install is one `copy_` into the packed copy's
    storage, which then holds what the step derives from the new weight."""
    from harness.dispatch_log import OpLog

    from vllm_delta.engine import derived

    model, found, weight = _observed(_AmxLikeAttention())
    attn, (unit,) = model[0], found.units
    impl, packed = attn.impl, attn.impl.packed
    kept, new = packed.clone(), weight.detach() + 1
    built = derived.prebuild(model, unit, {"0.kv_b_proj.weight": new})
    assert attn.impl is impl and impl.packed is packed and torch.equal(packed, kept)
    assert attn.kv_b_proj.weight is weight and not torch.equal(weight, new)
    with torch.no_grad():
        weight.copy_(new)  # the commit's scatter
    with OpLog() as log:
        built.install()
    assert [op.name for op in log.ops] == ["copy_"]
    assert impl.packed is packed and torch.equal(packed, new.t().float())


_SHARED = torch.zeros(4)  # state outside the unit that its step writes


class _WritesShared(_AmxLikeAttention):
    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        _SHARED.add_(1)


def test_step_writing_outside_its_module_is_not_run_on_a_stand_in():
    """A step that writes a tensor its module does not hold cannot run on a stand-in: nothing it would
    write is written, and the commit re-runs it in the pause (named in `in_pause`)."""
    from vllm_delta.engine import derived
    from vllm_delta.engine.stand_in import NotStandIn

    model, found, weight = _observed(_WritesShared())
    shared, packed = _SHARED.clone(), model[0].impl.packed.clone()
    with pytest.raises(NotStandIn, match="writes 1 tensor"):
        derived.prebuild(model, found.units[0], {"0.kv_b_proj.weight": weight.detach() + 1})
    assert torch.equal(_SHARED, shared) and torch.equal(model[0].impl.packed, packed)


def test_step_that_changes_a_checkpoint_parameter_is_refused():
    _, found, _ = _observed(_AmxLikeAttention(fold_into_weight=True))
    assert list(found.refused) == ["0"] and "0.kv_b_proj.weight" in found.refused["0"], found.refused


class _ReStride:
    """A quant-method-like step that rescales a weight into a column-major tensor of the same shape, so
    the module is "rerun" with a stash: offsets the probe learns on the live tensor would then address
    other elements of the checkpoint-layout stash."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.weight.data = (layer.weight.data * 2).t().contiguous().t()


def test_stash_whose_layout_the_live_param_does_not_extend_is_refused():
    from harness.synthetic import vllm_loop

    from vllm_delta.engine.transforms import UnsupportedTransform

    layer = torch.nn.Linear(3, 4, bias=False)
    layer.quant_method = _ReStride()
    with pytest.raises(
        UnsupportedTransform, match=r"re-lays weight from \(4, 3\) \(3, 1\) to \(4, 3\) \(1, 4\)"
    ):
        vllm_loop(torch.nn.Sequential(layer))
