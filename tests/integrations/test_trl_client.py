"""`integrations.trl.take`: what the client diffs survives a gather being undone behind it.

ZeRO-3 and FSDP cannot run on this machine (no DeepSpeed, no GPU); what they do to a yielded tensor when
TRL's iterator moves on is reproduced for real on the tensor: FSDP1's `summon_full_params(writeback=False)`
frees the unsharded storage (`_free_storage`: `untyped_storage().resize_(0)`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from vllm_delta.integrations.trl import sharded, take  # noqa: E402


def gathered(weights: dict[str, torch.Tensor]):
    """Yield a full copy of each tensor, and free its storage when the consumer asks for the next one."""
    for name, w in weights.items():
        full = w.clone()
        yield name, full
        full.untyped_storage().resize_(0)


def test_copies_survive_the_gather_and_reuse_their_buffers():
    weights = {"a": torch.randn(4, 3, dtype=torch.bfloat16), "b": torch.randn(5)}
    kept: dict[str, torch.Tensor] = {}
    got = take(gathered(weights), kept, copy=True)
    assert [n for n, _ in got] == ["a", "b"] and all(torch.equal(t, weights[n]) for n, t in got)
    storages = {n: t.untyped_storage().data_ptr() for n, t in got}
    weights["a"] += 1
    again = take(gathered(weights), kept, copy=True)
    assert torch.equal(dict(again)["a"], weights["a"])
    assert {n: t.untyped_storage().data_ptr() for n, t in again} == storages  # the same buffers every sync


def test_without_copy_the_live_tensors_are_diffed_in_place():
    w = torch.randn(3)
    ((_, got),) = take(iter([("w", w)]), {}, copy=False)
    assert got.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()


def test_a_process_without_an_accelerator_is_not_sharded():
    assert sharded() is False
