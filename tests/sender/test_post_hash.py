"""The whole-tensor xxh3 `post_hash` is opt-in: by default no scan reads a tensor whole for it (a
per-sync cost in the model's bytes); with `post_hash=True` every changed whole shard states the xxh3
of its bytes, computed here with `xxhash` directly, in a delta and in an anchor."""

from __future__ import annotations

import pytest
import torch
import xxhash

from vllm_delta.sender import Shard
from vllm_delta.sender import producer as producer_mod
from vllm_delta.sender.producer import Producer


def _shards() -> tuple[dict[str, torch.Tensor], list[Shard]]:
    gen = torch.Generator().manual_seed(3)
    w = {
        n: torch.randn(s, generator=gen).to(torch.bfloat16)
        for n, s in (("a", (64, 32)), ("b", (16,)), ("c", (8, 12)))
    }
    shards = [
        Shard.whole("a", w["a"]),
        Shard.whole("b", w["b"]),
        Shard.pieces("c", w["c"][:4], (8, 12), 0, [(0, 2), (4, 2)]),
    ]
    return w, shards


def _xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().view(torch.int16).numpy().tobytes())


@pytest.mark.parametrize("post_hash", [False, True])
def test_post_hash_only_when_asked(monkeypatch, post_hash: bool) -> None:
    calls = []
    real = producer_mod.tensor_digest
    monkeypatch.setattr(producer_mod, "tensor_digest", lambda t: calls.append(t.numel()) or real(t))
    w, shards = _shards()
    producer = Producer(snapshot="device", **({"post_hash": True} if post_hash else {}))
    producer.seed(shards)
    w["a"].view(-1)[::7] += 1  # "b" unchanged; the shard of "c" changes too
    w["c"].view(-1)[:3] += 1
    for kind, anchor in (("delta", False), ("delta", True)):
        calls.clear()
        hashes = {e.name: e.post_hash for e in producer.scan(shards, kind=kind, anchor=anchor).entries}
        if not post_hash:
            assert hashes == {"a": None, "b": None, "c": None} and calls == []
            continue
        assert hashes["a"] == _xxh3(w["a"]) and hashes["c"] is None  # a piece is not the whole tensor
        assert hashes["b"] == (_xxh3(w["b"]) if anchor else None)  # an anchor states every whole tensor
        assert calls == [w["a"].numel()] + ([w["b"].numel()] if anchor else [])


def test_the_sender_does_not_hash_by_default(tmp_path) -> None:
    from vllm_delta import DeltaSender

    assert DeltaSender(["http://127.0.0.1:9"], "disk", tmp_path).producer.post_hash is False
    assert DeltaSender(["http://127.0.0.1:9"], "disk", tmp_path, post_hash=True).producer.post_hash is True
