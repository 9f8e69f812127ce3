"""The multi-rank disk sender: two gloo ranks each own half the tensors; the engines see one version.

Two spawned processes (gloo on CPU, no vLLM). Rank 0 owns the even-indexed tensors, rank 1 the
odd ones. Rank 0 also hosts two FakeEngines (real HTTP, real wire decoding) and gathers rank 1's
tensors after every sync to check: each engine is bit-identical to the union of both ranks'
tensors, got exactly one POST per sync, and applied a version directory holding flush files from
both ranks under one merged manifest; the metrics report the changed count summed over the ranks
(on every rank) and the bytes of both ranks' files. Then: only one rank changes (one consistent
version, the quiet rank writes no file), one engine fails a version (both ranks keep the snapshot
at S), the catch-up that follows (per-rank `pending`, with reverts) converges both engines, and a
restarted engine (409, then a full anchor merged from both ranks while the other gets a catch-up in
the same sync; only rank 0 asks its status) converges too.
Each worker asserts; failures propagate through `megatron_cpu.spawn` (which needs no megatron).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from harness import megatron_cpu

from vllm_delta.wire import MANIFEST_NAME

pytestmark = pytest.mark.heavy  # two spawned processes: ~7 s, mostly interpreter and torch start-up

NAMES = [f"layer{i}.weight" for i in range(6)]
STEPS = 10


def _full_model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (32, 40), (64, 48), (40, 32), (7, 9)]
    return {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in zip(NAMES, shapes)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    return sum(int((a[k].view(torch.int16) != b[k].view(torch.int16)).sum()) for k in a)


def _worker(rank: int, world_size: int, port: int, root: str, result: str) -> None:
    import torch.distributed as dist
    from sender_helpers import FakeEngine, adam_like_step

    from vllm_delta import DeltaSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    root = Path(root)
    full = _full_model()
    mine = {n: full[n].clone() for n in NAMES[rank::world_size]}
    engines = [FakeEngine(root, full) for _ in range(2)] if rank == 0 else []
    box = [[e.url for e in engines]]
    dist.broadcast_object_list(box, src=0)
    urls = box[0]

    sender = DeltaSender(
        urls, "disk", root, flush_bytes=1024, retries=0, keep=True, group=group, max_pending_density=1.0
    )  # the scripted catch-ups, not a drop to anchor
    sender.seed(mine)
    assert sender.model_elements == sum(t.numel() for t in full.values()), (
        "model_elements is summed over ranks"
    )
    gen = torch.Generator().manual_seed(100 + rank)
    acked_union = {k: v.clone() for k, v in full.items()}  # rank 0: the weights at S
    log = []
    for v in range(1, STEPS + 1):
        # 4: only rank 1 changes; 5: only rank 0; 6: engine b fails; 7: catch-up (with reverts);
        # 8: engine b was restarted (409 on the base-relative delta); 9: anchor to b, catch-up to a.
        if v == 4 and rank == 0 or v == 5 and rank == 1:
            pass
        elif v == 7:
            before = {k: t.clone() for k, t in mine.items()}
            adam_like_step(mine, gen, density=0.3)
            for k in mine:  # revert part of step 6 (pending covers it) and part back to S (diff misses it)
                mine[k].view(-1)[:40] = before[k].view(-1)[:40]
                mine[k].view(-1)[:15] = sender.producer.snapshot_of(k)[:15]
        else:
            adam_like_step(mine, gen, density=0.3 if v == 6 else 0.05)
        if rank == 0 and v == 6:
            engines[1].fail_versions = {6}
        if rank == 0 and v == 8:
            engines[1].restart(full)
        m = sender.sync(iter(mine.items()) if v == 5 else mine)
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(
            ({k: t.clone() for k, t in mine.items()}, m, sender.snapshot_version), parts, dst=0
        )
        if rank != 0:
            continue
        union = {k: t for p in parts for k, t in p[0].items()}
        assert union.keys() == full.keys()
        acked = v not in (6, 8)
        expect_changed = _changed(union, acked_union)
        for r, (_, mr, snap_v) in enumerate(parts):
            assert mr["sender/changed_elements"] == expect_changed, (v, r, mr["sender/changed_elements"])
            assert mr["sender/version"] == v and mr["sender/all_acked"] == float(acked), (v, r)
            assert snap_v == {6: 5, 8: 7}.get(v, v), f"rank {r} snapshot at {snap_v} after sync {v}"
        assert m["perf/update_weights_density"] == expect_changed / sender.model_elements
        assert m["sender/catchup"] == float(v in (7, 9)) and m["sender/anchors"] == float(v == 9)
        dirs = sorted(root.glob(f"v{v:06d}*"))
        assert [d.name for d in dirs] == [f"v{v:06d}"] + ([f"v{v:06d}-anchor"] if v == 9 else [])
        wire = 0
        for d in dirs:
            manifest = json.loads((d / MANIFEST_NAME).read_text())
            on_disk = sorted(f.name for f in d.glob("rank*_flush*.safetensors"))
            assert sorted(f["name"] for f in manifest["files"]) == on_disk
            assert manifest["model_elements"] == sender.model_elements
            wire += sum((d / f).stat().st_size for f in on_disk)
            writers = {f[:8] for f in on_disk}
            expect_writers = {4: {"rank0001"}, 5: {"rank0000"}}.get(v, {"rank0000", "rank0001"})
            assert writers == expect_writers, (v, d.name, on_disk)
            assert not list(d.glob("*.tmp"))
            if d.name.endswith("-anchor"):
                assert sorted(p["name"] for p in manifest["params"]) == sorted(full)
        assert m["perf/update_weights_wire_bytes"] == wire
        if v == 8:
            assert sender.engines[engines[1].url].last_status == 409
        for i, e in enumerate(engines):
            posts = [r["version"] for r in e.requests]
            assert posts.count(v) == 1 and posts[-1] == v, f"engine {i}: POSTs {posts} after sync {v}"
            assert len(posts) == v
            anchor = v == 9 and i == 1
            assert e.requests[-1]["path"] == f"v{v:06d}" + ("-anchor" if anchor else "")
            assert e.requests[-1]["base_version"] == (None if v in (7, 9) else v - 1)
            failed = v in (6, 8) and i == 1
            expect_v, expect_w = {6: (5, acked_union), 8: (0, full)}[v] if failed else (v, union)
            assert e.version == expect_v and _same(e.weights, expect_w), f"engine {i} differs after sync {v}"
        if acked:
            acked_union = {k: t.clone() for k, t in union.items()}
        log.append(
            {"v": v, "changed": expect_changed, "files": sorted(f.name for d in dirs for f in d.iterdir())}
        )
    if rank == 0:
        for e in engines:
            e.close()
        Path(result).write_text(json.dumps(log))
    dist.barrier()


def test_two_ranks_one_version_per_sync(tmp_path):
    root, result = tmp_path / "deltas", tmp_path / "result.json"
    root.mkdir()
    megatron_cpu.spawn(_worker, 2, str(root), str(result), timeout=120)
    log = json.loads(result.read_text())
    assert [r["v"] for r in log] == list(range(1, STEPS + 1))
    assert all(r["changed"] > 0 for r in log)
    assert sorted(os.listdir(root)) == sorted([f"v{v:06d}" for v in range(1, STEPS + 1)] + ["v000009-anchor"])
