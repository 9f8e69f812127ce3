"""Integer parameters and a served dtype other than the checkpoint's (`--dtype`).

A base-relative encoding resolves each step on the served value cast back to the checkpoint's
dtype: exact only where the served dtype holds every checkpoint value (the same dtype, or bf16 /
fp16 served as float32). Elsewhere - an integer served wider, bf16 served as fp16 - prepare
refuses it with a 422 naming the param, before any write (it was a TypeError from torch.finfo on
integers, and bf16 -> fp16 passed the width check and resolved on rounded values). Overwrites
convert as vLLM's loader does (its `copy_` casts), so they are exact in any served dtype.

Light: synthetic modules on the CPU, compared with a full load by their own loader. Heavy: a real
engine served with `--dtype float16` on a bf16 checkpoint, against vLLM's fresh load of FINAL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.cli_diff import add_digests, diff
from harness.perturb import perturb_checkpoint
from harness.vllm_engine import greedy, start_llm
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.wire import DeltaWriter
from vllm_delta.wire.errors import DtypeMismatchError


class Served(nn.Module):
    """`ids` (an int32 checkpoint tensor) and `w` (bf16) served as the given dtypes; `w` also lands
    in `w2`, so its elements are held twice (the per-tensor, masked staging path)."""

    def __init__(self, ids_dtype: torch.dtype, w_dtype: torch.dtype, twice: bool = False) -> None:
        super().__init__()
        self.ids = nn.Parameter(torch.zeros(64, dtype=ids_dtype), requires_grad=False)
        self.w = nn.Parameter(torch.zeros(8, 8, dtype=w_dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(8, 8, dtype=w_dtype), requires_grad=False)
        self.twice = twice

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "ids":
                self.ids.data.copy_(t)  # the copy_ casts, as vLLM's default loader's does
            else:
                self.w.data.copy_(t)
                if self.twice:
                    self.w2.data.copy_(t)


CHECKPOINT = {"ids": ((64,), torch.int32), "w": ((8, 8), torch.bfloat16)}


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(-1000, 1000, (64,), dtype=torch.int32, generator=g),
        "w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
    }


def stepped(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A "training step": some ids and weights moved, by small and large amounts."""
    new = {n: t.clone() for n, t in old.items()}
    new["ids"][::3] += torch.arange(22, dtype=torch.int32) - 11
    new["w"].view(-1)[::5] = (new["w"].view(-1)[::5].float() * 1.5 + 0.01).to(torch.bfloat16)
    return new


def write(path: Path, old, new, names, encoding: str) -> Path:
    with DeltaWriter(path, version=1, base_version=0, encoding=encoding) as writer:
        for n in names:
            a, b = old[n].reshape(-1), new[n].reshape(-1)
            pos = torch.nonzero(
                a.view(torch.uint8).view(a.numel(), -1).ne(b.view(torch.uint8).view(b.numel(), -1)).any(1)
            ).squeeze(1)
            writer.add(n, pos, b[pos], a[pos], shape=tuple(old[n].shape))
    return path


def loaded(ckpt, *dtypes, twice=False) -> Served:
    m = Served(*dtypes, twice=twice)
    m.load_weights(ckpt.items())
    return m


def same_bits(a: nn.Module, b: nn.Module) -> list[str]:
    return [
        n
        for n, p in a.named_parameters()
        if not torch.equal(p.view(torch.uint8), getattr(b, n).view(torch.uint8))
    ]


@pytest.mark.parametrize("twice", [False, True], ids=["batched", "masked"])
@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_exact_where_the_served_dtype_holds_the_checkpoints(tmp_path, twice, encoding, w_dtype):
    """An int32 param base-relative (it raised TypeError), and bf16 served as bf16 or float32."""
    old = checkpoint(0)
    new = stepped(old)
    m = loaded(old, torch.int32, w_dtype, twice=twice)
    applier = DeltaApplier(m, CHECKPOINT)
    staged = applier.prepare(
        write(tmp_path / "d", old, new, ["ids", "w"], encoding), version=1, base_version=0, current_version=0
    )
    applier.commit(staged)
    assert same_bits(m, loaded(new, torch.int32, w_dtype, twice=twice)) == []


@pytest.mark.parametrize("twice", [False, True], ids=["batched", "masked"])
@pytest.mark.parametrize(
    "name,dtypes",
    [
        ("ids", (torch.int64, torch.bfloat16)),
        ("w", (torch.int32, torch.float16)),
        ("w", (torch.int32, torch.float8_e4m3fn)),
    ],
    ids=["int32-as-int64", "bf16-as-fp16", "bf16-as-fp8"],
)
def test_a_base_relative_step_that_cannot_be_resolved_is_a_422_before_any_write(
    tmp_path, twice, name, dtypes
):
    old = checkpoint(0)
    m = loaded(old, *dtypes, twice=twice)
    before = {n: p.clone() for n, p in m.named_parameters()}
    delta = write(tmp_path / "d", old, stepped(old), ["ids", "w"], "ulp_zstd")
    with pytest.raises(DtypeMismatchError, match="base-relative") as err:
        DeltaApplier(m, CHECKPOINT).prepare(delta, version=1, base_version=0, current_version=0)
    assert err.value.http_status == 422 and err.value.param == name
    assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in m.named_parameters())


@pytest.mark.parametrize(
    "dtypes", [(torch.int64, torch.float16), (torch.int64, torch.float32)], ids=["fp16", "fp32"]
)
def test_an_overwrite_converts_as_the_loader_does(tmp_path, dtypes):
    old = checkpoint(0)
    new = stepped(old)
    m = loaded(old, *dtypes)
    applier = DeltaApplier(m, CHECKPOINT)
    applier.commit(
        applier.prepare(
            write(tmp_path / "d", old, new, ["ids", "w"], "indices"),
            version=1,
            base_version=0,
            current_version=0,
        )
    )
    assert same_bits(m, loaded(new, *dtypes)) == []


@pytest.mark.parametrize("w_dtype,ok", [(torch.float32, True), (torch.float16, False)], ids=["fp32", "fp16"])
def test_a_pre_digest_is_checked_only_where_the_served_values_convert_back(tmp_path, w_dtype, ok):
    """fp16 rounds bf16's small values: a pre_digest summed on them would call the engine off its base."""
    from vllm_delta.engine.digests import check_partials

    old = checkpoint(0)
    old["w"].view(-1)[::7] = torch.tensor(3e-6).to(torch.bfloat16)  # below fp16's normal range: rounded there
    new = stepped(old)
    m = loaded(old, torch.int32, w_dtype)
    delta = add_digests(write(tmp_path / "d", old, new, ["ids", "w"], "indices"), old, new)
    applier = DeltaApplier(m, CHECKPOINT)
    if not ok:
        with pytest.raises(DtypeMismatchError, match="pre_digest cannot be checked") as err:
            applier.prepare(delta, version=1, base_version=0, current_version=0)
        assert err.value.http_status == 422 and err.value.param == "w"
        return
    staged = applier.prepare(delta, version=1, base_version=0, current_version=0)
    assert check_partials([{"digests": staged.digests, "expected": staged.expected}]) == 4
    applier.commit(staged)
    assert same_bits(m, loaded(new, torch.int32, w_dtype)) == []


# ---- heavy: a real engine served as float16 ------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.engine
def test_engine_served_as_float16_matches_a_fresh_load(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama")  # bf16
    final = perturb_checkpoint(base, tmp_path / "final", density=0.05, seed=7)
    deltas = {}
    for encoding in ("ulp_zstd", "indices"):
        deltas[encoding] = tmp_path / f"delta_{encoding}"
        diff(base, final, deltas[encoding], encoding, 1, 0)
    with start_llm(final, dtype="float16", delta=True) as llm:
        reference = llm.collective_rpc("compute_weight_checksums")
        reference_out = greedy(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(base)})
        base_sums = llm.collective_rpc("compute_weight_checksums")
        llm.collective_rpc("delta_set_peers", args=(llm.collective_rpc("delta_coverage"),))
        request = {
            "path": str(deltas["ulp_zstd"]),
            "version": 1,
            "base_version": 0,
            "files": None,
            "max_staged_bytes": 1 << 20,
        }
        (refused,) = llm.collective_rpc("delta_prepare", args=({**request, "id": "ulp"},))
        unchanged = llm.collective_rpc("compute_weight_checksums")
        (prepared,) = llm.collective_rpc(
            "delta_prepare", args=({**request, "id": "ow", "path": str(deltas["indices"])},)
        )
        (committed,) = llm.collective_rpc("delta_commit", args=("ow",))
        applied = llm.collective_rpc("compute_weight_checksums")
        applied_out = greedy(llm)
    assert not refused["ok"] and refused["status"] == 422, refused
    assert refused["error"]["type"] == "DtypeMismatchError" and refused["error"]["param"], refused
    assert "float16" in refused["error"]["message"], refused
    assert unchanged == base_sums and base_sums != reference
    assert prepared["ok"] and prepared["fallback"] == [] and committed["ok"], (prepared, committed)
    assert [n for n in reference[0] if applied[0][n] != reference[0][n]] == []
    assert applied_out == reference_out
