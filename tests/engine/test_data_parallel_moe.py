"""A MoE model's DP engines on `POST /update_weights_delta` (issue 17, item 7: DP attention plus EP).

Why: vLLM keeps `data_parallel_size > 1` inside the engine only for MoE models and splits their
experts across the DP x TP ranks (`FusedMoEParallelConfig.make`: EP across DP x TP, or the experts'
TP flattened across DP), while attention and the dense weights are replicated on every engine. No
engine holds the whole model, so the route checks each tensor with the group that holds it whole:
the split experts over all DP engines as one world (ranks in (dp, rank) order), the replicated
weights per engine, as under dense DP. vLLM 0.32's CPU build cannot run such an engine's forward, so
the engines here are the synthetic model with its experts placed and loaded by vLLM's own code
(harness/data_parallel.py), behind a client shaped like `DPLBAsyncMPClient`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import requests
import torch
from harness.data_parallel import DPLBEngine, moe_dp_engines, moe_dp_rank, replica_checksums
from harness.engine_pool import API_KEY
from harness.synthetic import device_check, loaded
from harness.vllm_engine import VllmServer
from safetensors.torch import load_file

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.replicas import moe_world
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.wire import load_manifest, write_manifest
from vllm_delta.wire.additive import combine

DC = device_check()
CFG = DC.SIZES["tiny"]
MOE = f"model.layers.{CFG.layers - 1}"  # the tiny model's MoE layer
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
LAYOUTS = {  # (TP per engine, --enable-expert-parallel)
    "ep-tp1": (1, True),  # DeepSeek-V3's usual layout: DP attention, experts split across the DP engines
    "ep-tp2": (2, True),
    "flat-tp1": (1, False),  # no EP: each expert's TP flattened across the DP engines
}


def setup(tmp_path: Path, layout: str, dp: int = 2):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    tp, ep = LAYOUTS[layout]
    models, engines = moe_dp_engines(tmp_path / "model", base, tp=tp, dp=dp, ep=ep)
    root = tmp_path / "root"
    root.mkdir()
    return base, models, DeltaUpdater(DPLBEngine(engines), root, 1 << 20, [])


def update(updater: DeltaUpdater, name: str, version: int = 1) -> dict:
    return asyncio.run(
        updater.update(DeltaUpdateRequest(path=name, version=version, base_version=version - 1))
    )


def expected_experts(ckpt: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A rank's fused expert tensors cut straight from the checkpoint: vLLM's linear placement (EP rank
    r holds experts r*local .. r*local+local-1) and its TP slice of each projection's intermediate dim."""
    moe = model.moe.config
    local = CFG.experts // moe.ep_size
    n = CFG.moe_inter // moe.tp_size
    rows = slice(moe.tp_rank * n, (moe.tp_rank + 1) * n)
    experts = range(moe.ep_rank * local, (moe.ep_rank + 1) * local)
    at = f"{MOE}.mlp.experts"
    return {
        f"{at}.w13_weight": torch.stack(
            [
                torch.cat([ckpt[f"{at}.{e}.gate_proj.weight"][rows], ckpt[f"{at}.{e}.up_proj.weight"][rows]])
                for e in experts
            ]
        ),
        f"{at}.w2_weight": torch.stack([ckpt[f"{at}.{e}.down_proj.weight"][:, rows] for e in experts]),
    }


def differing(ckpt: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Parameters of one rank whose bits differ from the checkpoint's direct slices."""
    tp = model.tp
    want = dict(loaded(ckpt, model.rank, tp).named_parameters())  # attention / dense: this engine's TP slice
    want.update(expected_experts(ckpt, model))
    return [
        n
        for n, p in model.named_parameters()
        if not torch.equal(p.view(torch.int16), want[n].view(torch.int16))
    ]


def snapshot(models: list[list[torch.nn.Module]]) -> list[list[dict[str, torch.Tensor]]]:
    return [[{n: p.clone() for n, p in m.named_parameters()} for m in engine] for engine in models]


def unchanged(models, before) -> bool:
    return all(
        torch.equal(p, b[n])
        for engine, was in zip(models, before)
        for m, b in zip(engine, was)
        for n, p in m.named_parameters()
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_engine_applies_bit_exact(tmp_path, layout):
    base, models, updater = setup(tmp_path, layout)
    tp = LAYOUTS[layout][0]
    assert [differing(base, m) for engine in models for m in engine] == [[]] * (
        2 * tp
    )  # the harness loads right
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    result = update(updater, "v1")
    assert [differing(new, m) for engine in models for m in engine] == [[]] * (2 * tp)
    assert result["replicas"] == [{"dp": 0, "version": 1, "ranks": tp}, {"dp": 1, "version": 1, "ranks": tp}]
    assert [(r["dp"], r["rank"]) for r in result["ranks"]] == [(d, r) for d in (0, 1) for r in range(tp)]
    experts = {n for n in new if ".experts." in n}
    assert updater.across_dp == experts  # the split tensors are the experts; attention is per engine
    status = asyncio.run(updater.status())
    assert status["healthy"] and [(r["dp"], r["version"], r["dirty"]) for r in status["replicas"]] == [
        (0, 1, False),
        (1, 1, False),
    ]
    report = asyncio.run(updater.verify())
    assert report["ok"] and report["across_dp"]["digests_checked"] == len(experts)
    assert [r["digests_checked"] for r in report["replicas"]] == [len(new) - len(experts)] * 2
    assert updater.engine.paused == [False, False]


def changed_element(base, new, name: str, rows: range | None = None) -> tuple[int, int]:
    """(row, col) of an element the delta changes in 2-D tensor `name` (within `rows` if given)."""
    changed = torch.nonzero(base[name].view(torch.int16) != new[name].view(torch.int16)).tolist()
    return next((r, c) for r, c in changed if rows is None or r in rows)


DRIFTS = {  # where one held copy moved off the base, and how the refusal names the group that saw it
    "attention-dp0": (O_PROJ, 0, "dp0: pre-apply"),
    "attention-dp1": (O_PROJ, 1, "dp1: pre-apply"),  # dp0's copy matches; only dp1's own check sees it
    "expert-dp0": (f"{MOE}.mlp.experts.1.down_proj.weight", 0, "across DP engines: pre-apply"),
    "expert-dp1": (f"{MOE}.mlp.experts.2.down_proj.weight", 1, "across DP engines: pre-apply"),
}


@pytest.mark.parametrize("case", DRIFTS)
def test_a_drifted_copy_is_refused_with_every_engine_unchanged(tmp_path, case):
    """DP attention + EP (TP=1 engines, two experts each): one engine's copy of an element the delta
    changes differs from the base. The group that holds it whole refuses (400) before any write."""
    name, dp, message = DRIFTS[case]
    base, models, updater = setup(tmp_path, "ep-tp1")
    new = DC.step(base, 0.3, seed=2)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    row, col = changed_element(base, new, name)
    model = models[dp][0]
    if ".experts." in name:
        expert = int(name.split(".")[-3])
        assert model.moe.expert_map[expert] >= 0, "the drifted engine holds this expert"
        model.model.layers[-1].mlp.experts.w2_weight.data.view(torch.int16)[
            int(model.moe.expert_map[expert]), row, col
        ] += 1
    else:
        model.model.layers[0].self_attn.o_proj.weight.data.view(torch.int16)[row, col] += 1
    before = snapshot(models)
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert err.value.error["param"] == name and err.value.error["message"].startswith(message), (
        err.value.error
    )
    assert set(err.value.error["ranks"]) == {"dp0:rank0", "dp1:rank0"}
    assert unchanged(models, before) and updater.engine.paused == [False, False] and updater.fault is None


def test_a_refusal_by_every_worker_names_each_of_them(tmp_path):
    """A flush whose bytes fail its file hash is refused by each worker with an error reply that does
    not carry the worker's rank; the route still names every worker (it once said `dp0:rankNone`)."""
    base, models, updater = setup(tmp_path, "ep-tp2")
    DC.write_delta(updater.root / "v1", base, DC.step(base, 0.3, seed=3), version=1)
    flush = next((updater.root / "v1").glob("*.safetensors"))
    data = bytearray(flush.read_bytes())
    data[-1] ^= 0xFF
    flush.write_bytes(bytes(data))
    before = snapshot(models)
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert set(err.value.error["ranks"]) == {"dp0:rank0", "dp0:rank1", "dp1:rank0", "dp1:rank1"}, (
        err.value.error
    )
    assert unchanged(models, before) and updater.engine.paused == [False, False]


def test_each_worker_parses_the_manifest_once(tmp_path, monkeypatch):
    """The worker opens the delta for its lineage check and hands that to prepare: a manifest of 46k
    entries parsed twice was ~4 us a checkpoint tensor more on every rank."""
    from vllm_delta.wire import reader

    base, models, updater = setup(tmp_path, "ep-tp1")
    DC.write_delta(updater.root / "v1", base, DC.step(base, 0.3, seed=4), version=1)
    parses = []
    real = reader.parse_manifest
    monkeypatch.setattr(reader, "parse_manifest", lambda text: parses.append(1) or real(text))
    update(updater, "v1")
    assert len(parses) == sum(len(engine) for engine in models)


def test_verify_sees_a_drifted_replicated_copy_and_a_drifted_expert(tmp_path):
    base, models, updater = setup(tmp_path, "ep-tp1")
    new = DC.step(base, 0.3, seed=3)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    update(updater, "v1")
    models[1][0].model.norm.weight.data.view(torch.int16)[0] += 1  # replicated on both engines
    models[1][0].model.layers[-1].mlp.experts.w13_weight.data.view(torch.int16)[0, 0, 0] += 1  # expert 2's
    report = asyncio.run(updater.verify())
    assert not report["ok"] and [r["digest_mismatched"] for r in report["replicas"]] == [
        [],
        ["model.norm.weight"],
    ]
    assert report["across_dp"]["digest_mismatched"] == [f"{MOE}.mlp.experts.2.gate_proj.weight"]


def hole_setup(tmp_path: Path, read: bool):
    """DP attention + EP at TP=1, engine 1 built with engine 0's DP rank: experts 2 and 3 are held by no
    rank. With `read`, engine 1's loaders still read expert 3's tensors (without writing them anywhere)."""
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    models, engines = moe_dp_engines(tmp_path / "model", base, tp=1, dp=2, ep=True)
    twin = moe_dp_rank(CFG, tp=1, dp=2, dp_rank=0, tp_rank=0, ep=True)
    if read:
        for param in (
            twin.model.layers[-1].mlp.experts.w13_weight,
            twin.model.layers[-1].mlp.experts.w2_weight,
        ):

            def load(p, w, shard, vllm_load=param.weight_loader):
                if shard[0] == 3:
                    w.clone()  # read, and dropped
                vllm_load(p, w, shard)

            param.weight_loader = load
    twin.load_weights(base.items())
    engines[1].workers[0].model_runner.get_model = lambda: twin
    models[1][0] = twin
    root = tmp_path / "root"
    root.mkdir()
    return base, models, DeltaUpdater(DPLBEngine(engines), root, 1 << 20, [])


def test_an_expert_no_engine_holds_is_refused(tmp_path):
    """No rank's loader even reads experts 2 and 3 (as for a tensor vLLM ignores): a delta that changes
    them is refused by the pre-apply digest (no rank counts them), every engine unchanged."""
    base, models, updater = hole_setup(tmp_path, read=False)
    DC.write_delta(updater.root / "v1", base, DC.step(base, 0.3, seed=4), version=1)
    before = snapshot(models)
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert ".experts.2." in err.value.error["param"] or ".experts.3." in err.value.error["param"]
    assert unchanged(models, before) and updater.engine.paused == [False, False]


def test_an_expert_read_but_held_by_no_engine_is_refused_at_startup(tmp_path):
    """Engine 1's loader reads expert 3 but no rank of the DP world holds a copy: the coverage check over
    the whole world names it, every update is refused (500), and the status shows the coverage error."""
    base, models, updater = hole_setup(tmp_path, read=True)
    DC.write_delta(updater.root / "v1", base, DC.step(base, 0.3, seed=4), version=1)
    before = snapshot(models)
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert err.value.status == 500 and err.value.error["type"] == "CoverageError", err.value.error
    assert ".experts.3." in err.value.error["param"] and "no rank holds" in err.value.error["message"]
    coverage = asyncio.run(updater.status())["placement"]["coverage"]
    assert not coverage["ok"] and {n for n in coverage["errors"] if ".experts." in n} == {
        f"{MOE}.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    assert unchanged(models, before)


def test_the_world_is_ordered_dp_then_rank():
    """Two TP=2 engines. `a` is held whole by every rank (replicated): counted by each engine's rank 0.
    `x` is split across the engines, each element on two ranks (A = [0, 2) on dp0:rank1 and dp1:rank0,
    B = [2, 4) on dp1:rank0 and dp1:rank1, C = [4, 6) on dp0:rank0 and dp1:rank1): each element is
    counted by its lowest holder in (dp, rank) order, so dp1:rank0 counts B only."""
    a, b, c = [0, [2], [1]], [2, [2], [1]], [4, [2], [1]]
    held = {(0, 0): [c], (0, 1): [a], (1, 0): [a, b], (1, 1): [b, c]}

    def reply(dp: int, rank: int) -> dict:
        return {"rank": rank, "coverage": {"a": [[0, [4], [1]]], "x": held[dp, rank]}}

    groups = {1: [reply(1, 1), reply(1, 0)], 0: [reply(0, 0), reply(0, 1)]}  # any reply order
    shares, counted = {}, {}
    for dp in (0, 1):
        for rank in (0, 1):
            ownership, report, across = moe_world(groups, dp, rank, {"a": (4,), "x": (6,)})
            assert report["ok"] and across == ["x"]
            shares[dp, rank] = (ownership.share("a"), ownership.share("x"))
            counted[dp, rank] = ownership.counted("x", torch.arange(6)).tolist()
    assert shares == {
        (0, 0): ("all", "all"),
        (0, 1): ("none", "all"),
        (1, 0): ("all", "some"),
        (1, 1): ("none", "none"),
    }
    assert counted[1, 0] == [False, False, True, True, False, False]


# ---- a real `vllm serve --data-parallel-size 2 --enable-expert-parallel` of a tiny Qwen3-MoE on CPU -------


def corrupted(path: Path, name: str) -> None:
    """The delta at `path` with `name`'s post-apply digest off by one: its prepare must be refused."""
    manifest = load_manifest(path)
    params = [
        p.model_copy(update={"post_digest": combine(p.post_digest, "0" * 31 + "1")}) if p.name == name else p
        for p in manifest.params
    ]
    write_manifest(path, manifest.model_copy(update={"params": params}))


@pytest.mark.heavy
def test_real_dp2_ep_engine_learns_the_world_and_checks_digests_across_it(tiny_model_factory, tmp_path):
    """vLLM 0.32's CPU build starts this engine (each DP engine holds two of the four experts and all of
    attention) and the probe learns both engines' placement from vLLM's own loaders; the world's
    coverage holds. Its first MoE forward raises NotImplementedError (`all_gatherv`, through
    naive_dp_ep.py), and the route's pause for a commit makes the DP engines run one (a dummy batch),
    so a delta that changes weights cannot be committed here: what is checked is everything before the
    pause. A delta whose expert digest is wrong is refused by the check across the DP engines, one whose
    attention digest is wrong by the engine's own check, weights unchanged; an empty delta commits on both."""
    model_dir = tiny_model_factory("qwen3_moe")
    base = {n: t for f in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    root = tmp_path / "root"
    root.mkdir()
    new = DC.step(base, 0.05, seed=5)
    expert, attention = (
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    )
    for name in (expert, attention):
        DC.write_delta(root / name, base, new, version=1)
        corrupted(root / name, name)
    DC.write_delta(root / "empty", base, base, version=1)
    DC.write_delta(root / "kills", base, new, version=2)
    args = [
        "--enable-delta-updates",
        "--delta-updates-root",
        str(root),
        "--api-key",
        API_KEY,
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
        "--enable-expert-parallel",
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with VllmServer(
        model_dir, tmp_path / "dp_ep.log", extra_args=args, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    ) as server:
        url = server.url
        before = replica_checksums(url)
        assert sorted(before) == [0, 1]
        for name, where in ((expert, "across DP engines: post-apply"), (attention, "dp0: post-apply")):
            r = requests.post(
                f"{url}/update_weights_delta",
                json={"path": name, "version": 1, "base_version": 0},
                headers=headers,
                timeout=300,
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "IntegrityError" and error["param"] == name, error
            assert error["message"].startswith(where) and set(error["ranks"]) == {"dp0:rank0", "dp1:rank0"}, (
                error
            )
        status = requests.get(f"{url}/delta_updates/status", headers=headers, timeout=60).json()
        assert status["healthy"] and [r["placement"]["coverage"]["ok"] for r in status["ranks"]] == [
            True,
            True,
        ]
        assert [(r["dp"], r["version"]) for r in status["replicas"]] == [(0, 0), (1, 0)]
        assert replica_checksums(url) == before, "a refused delta changed an engine's weights"
        r = requests.post(
            f"{url}/update_weights_delta",
            json={"path": "empty", "version": 1, "base_version": 0},
            headers=headers,
            timeout=300,
        )
        assert r.status_code == 200, r.text
        assert r.json()["replicas"] == [
            {"dp": 0, "version": 1, "ranks": 1},
            {"dp": 1, "version": 1, "ranks": 1},
        ]
        # A delta that changes weights: the pause runs the DP engines' dummy MoE batch, which raises on
        # this build and kills both engine cores. The request must end (vLLM's EngineDeadError handler,
        # then its shutdown), not hang until the server is killed, as it did before transaction.while_alive.
        r = requests.post(
            f"{url}/update_weights_delta",
            json={"path": "kills", "version": 2, "base_version": 1},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 500, r.text
        assert server.proc.wait(timeout=60) is not None, "the server did not shut down after its engines died"
