"""`--data-parallel-size N` on `POST /update_weights_delta` (issue 17, item 7).

Why: under vLLM's internal load balancer (`DPLBAsyncMPClient`) `collective_rpc` reaches every DP engine
but answers with the first engine's replies only, so another replica's refusal or failed commit was
lost. The route now calls every engine (engine/replicas.py) and checks each replica on its own: each
dense DP replica holds the whole model, so its counted-once digests must match the manifest by itself.

Light: two TP=2 replicas of the synthetic vLLM-shaped model behind a client shaped like
`DPLBAsyncMPClient` (a replica that drifted is refused, naming it; verify per replica), the parse-time
checks, and the MoE-under-DP refusal. Heavy: a real `vllm serve --data-parallel-size 2` on CPU, each
replica bit-exact against vLLM's fresh load of the new checkpoint (vLLM's own `/weight_checker`,
whose keys carry each engine's DP index), and a bad delta refused with both replicas unchanged.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from harness.data_parallel import DPLBEngine, replica_checksums, unprefixed
from harness.engine_pool import API_KEY
from harness.fresh_load import save_checkpoint
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine import cli_args
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.wire import load_manifest, write_manifest
from vllm_delta.wire.additive import combine

DC = device_check()
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: each TP rank holds half the columns


def dp_setup(tmp_path: Path, dp: int = 2):
    """`dp` replicas of two TP ranks each on the same checkpoint, each worker with its DP index."""
    base = DC.random_checkpoint(DC.SIZES["tiny"], "cpu", seed=0)
    replicas = []
    for i in range(dp):
        models, workers = tp_ranks(tmp_path / "model", base, tp=2)
        for w in workers:  # as vLLM configures a dense DP engine (reconfigure_for_independent_dp_rank)
            w.vllm_config.parallel_config = SimpleNamespace(data_parallel_index=i, data_parallel_size=1)
        replicas.append((models, workers))
    root = tmp_path / "root"
    root.mkdir()
    engine = DPLBEngine([InProcessEngine(workers) for _, workers in replicas])
    return base, [models for models, _ in replicas], DeltaUpdater(engine, root, 1 << 20, [])


def update(updater: DeltaUpdater, name: str, version: int = 1) -> dict:
    return asyncio.run(
        updater.update(DeltaUpdateRequest(path=name, version=version, base_version=version - 1))
    )


def test_every_replica_applies_and_reports_its_dp_rank(tmp_path):
    base, replicas, updater = dp_setup(tmp_path)
    new = DC.step(base, 0.3, seed=1)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    result = update(updater, "v1")
    assert result["replicas"] == [{"dp": 0, "version": 1, "ranks": 2}, {"dp": 1, "version": 1, "ranks": 2}]
    assert [(r["dp"], r["rank"]) for r in result["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for models in replicas:
        for rank, m in enumerate(models):
            assert same_bits(m, loaded(new, rank, 2)) == []
    status = asyncio.run(updater.status())
    assert status["healthy"] and status["version"] == 1
    assert [(r["dp"], r["version"], r["dirty"]) for r in status["replicas"]] == [(0, 1, False), (1, 1, False)]
    assert updater.engine.paused == [False, False]


@pytest.mark.parametrize("drifted", [0, 1])
def test_a_replica_that_drifted_is_refused_by_its_own_digests(tmp_path, drifted):
    """One replica's rank holds a changed element that differs from the base: that replica's pre-digest
    fails on its own (the other replica's copy cannot vouch for it) and nothing changes anywhere."""
    base, replicas, updater = dp_setup(tmp_path)
    new = DC.step(base, 0.3, seed=2)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    changed = torch.nonzero(base[O_PROJ].view(torch.int16) != new[O_PROJ].view(torch.int16))
    row, col = (int(i) for i in changed[0])
    width = replicas[drifted][0].model.layers[0].self_attn.o_proj.weight.shape[1]
    shard = replicas[drifted][col // width].model.layers[0].self_attn.o_proj.weight
    shard.data.view(torch.int16)[row, col % width] += 7
    before = [[{n: p.clone() for n, p in m.named_parameters()} for m in models] for models in replicas]
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert err.value.status == 400 and err.value.error["type"] == "IntegrityError"
    assert err.value.error["param"] == O_PROJ and err.value.error["message"].startswith(
        f"dp{drifted}: pre-apply"
    )
    assert set(err.value.error["ranks"]) == {"dp0:rank0", "dp0:rank1", "dp1:rank0", "dp1:rank1"}
    for models, was in zip(replicas, before):
        for m, b in zip(models, was):
            assert all(torch.equal(p, b[n]) for n, p in m.named_parameters())
    assert updater.engine.paused == [False, False] and updater.fault is None


def test_a_commit_that_fails_on_one_replica_keeps_every_replica_paused(tmp_path):
    """Replica 1's rank 1 scatter raises (its destination swapped for a too-small tensor while the route
    pauses): the answer names that rank, every engine stays paused, and the status marks that replica."""
    base, _, updater = dp_setup(tmp_path)
    victim = "model.layers.1.mlp.experts.w13_weight"
    engine = updater.engine
    pause = engine.pause_generation

    async def pause_and_break(mode: str, clear_cache: bool) -> None:
        await pause(mode, clear_cache)
        engine.replicas[1].workers[1]._delta().applier.targets[victim] = torch.zeros(4, dtype=torch.bfloat16)

    engine.pause_generation = pause_and_break
    DC.write_delta(updater.root / "v1", base, DC.step(base, 0.3, seed=4), version=1)
    with pytest.raises(UpdateError) as err:
        update(updater, "v1")
    assert err.value.status == 500 and victim in err.value.error["message"]
    assert {k: v["ok"] for k, v in err.value.error["ranks"].items()} == {
        "dp0:rank0": True,
        "dp0:rank1": True,
        "dp1:rank0": True,
        "dp1:rank1": False,
    }
    assert engine.paused == [True, True] and updater.fault["rank_ids"] == ["dp1:rank1"]
    status = asyncio.run(updater.status())
    assert not status["healthy"] and [(r["dp"], r["dirty"]) for r in status["replicas"]] == [
        (0, False),
        (1, True),
    ]


def test_verify_checks_each_replica_on_its_own(tmp_path):
    base, replicas, updater = dp_setup(tmp_path)
    new = DC.step(base, 0.3, seed=3)
    DC.write_delta(updater.root / "v1", base, new, version=1)
    update(updater, "v1")
    report = asyncio.run(updater.verify())
    assert report["ok"] and [r["digests_checked"] for r in report["replicas"]] == [len(new), len(new)]
    replicas[1][0].model.norm.weight.data.view(torch.int16)[0] += (
        1  # replicated on both TP ranks: counted once
    )
    report = asyncio.run(updater.verify())
    assert not report["ok"] and report["digest_mismatched"] == ["model.norm.weight"]
    assert [r["digest_mismatched"] for r in report["replicas"]] == [[], ["model.norm.weight"]]


@pytest.fixture
def serve_parser(monkeypatch):
    """`vllm serve`'s parser on `model *argv` (with our plugin's hook), nothing delta-related in the env."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in ("VLLM_SERVER_DEV_MODE", "VLLM_API_KEY", cli_args.ENV_FLAG, ROOT_ENV, "VLLM_PLUGINS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return lambda *argv: make_arg_parser(FlexibleArgumentParser()).parse_args(["model", *argv])


REFUSED = {
    "dp-implicit-api-servers": (["--data-parallel-size", "2"], "pass --api-server-count 1"),
    "api-servers": (["--data-parallel-size", "2", "--api-server-count", "2"], "--api-server-count 2"),
    "external-lb": (
        ["--data-parallel-size", "2", "--api-server-count", "1", "--data-parallel-external-lb"],
        "not --data-parallel-external-lb",
    ),
    "hybrid-lb": (
        ["--data-parallel-size", "2", "--api-server-count", "1", "--data-parallel-hybrid-lb"],
        "not --data-parallel-hybrid-lb",
    ),
    "dp-rank": (
        ["--data-parallel-size", "2", "--api-server-count", "1", "--data-parallel-rank", "1"],
        "not --data-parallel-rank",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_data_parallel_command_lines_refused_at_parse_time(serve_parser, tmp_path, capsys, case):
    flags, message = REFUSED[case]
    with pytest.raises(SystemExit) as exc:
        serve_parser(
            "--enable-delta-updates", "--delta-updates-root", str(tmp_path), "--api-key", "k", *flags
        )
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_data_parallel_with_one_api_server_is_accepted(serve_parser, tmp_path):
    args = serve_parser(
        "--enable-delta-updates",
        "--delta-updates-root",
        str(tmp_path),
        "--api-key",
        "k",
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
    )
    assert args.data_parallel_size == 2 and args.api_server_count == 1
    args.api_server_count = None  # what `vllm serve` hands its one API server (entrypoints/cli/serve.py)
    cli_args.check_args(args)  # the route plugin's check when the app is built


# ---- a real `vllm serve --data-parallel-size 2` on CPU
# ------------------------------------------------------


@pytest.fixture(scope="module")
def dp_server(tiny_model_factory, tmp_path_factory, delta_root):
    """A module-scoped `vllm serve --data-parallel-size 2 --api-server-count 1` of the tiny Llama on the
    session's delta root, one core per engine (VLLM_CPU_OMP_THREADS_BIND is split by DP rank,
    vllm/utils/ompmultiprocessing.py)."""
    from harness.vllm_engine import VllmServer

    args = [
        "--enable-delta-updates",
        "--delta-updates-root",
        str(delta_root),
        "--api-key",
        API_KEY,
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
    ]
    log = tmp_path_factory.mktemp("dp") / "dp.log"
    with VllmServer(
        tiny_model_factory("llama"), log, extra_args=args, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    ) as server:
        yield server


@pytest.mark.heavy
def test_real_dp2_engine_applies_on_both_replicas_and_refuses_a_bad_delta(
    dp_server, deltas, fresh_loader, tiny_model_factory, tmp_path
):
    server, model_dir = dp_server, tiny_model_factory("llama")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    new = deltas.perturbed(sorted(deltas.base), seed=11, density=0.05)
    path = deltas.fresh_dir("v1")  # with the manifest's additive digests: each replica's partials checked
    DC.write_delta(path, deltas.base, new, version=1)
    r = requests.post(
        f"{server.url}/update_weights_delta",
        json={"path": path.name, "version": 1, "base_version": 0},
        headers=headers,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["replicas"] == [{"dp": 0, "version": 1, "ranks": 1}, {"dp": 1, "version": 1, "ranks": 1}]
    want = unprefixed(fresh_loader.checksums(save_checkpoint(new, model_dir, tmp_path / "new")))
    got = replica_checksums(server.url)
    assert sorted(got) == [0, 1]
    for dp in (0, 1):
        assert got[dp] == want, f"dp{dp}: {sorted(n for n in want if got[dp].get(n) != want[n])}"
    verify = requests.post(f"{server.url}/delta_updates/verify", headers=headers, timeout=120).json()
    assert verify["ok"] and [v["dp"] for v in verify["replicas"]] == [0, 1]
    for prompt in ("The quick brown fox", "One two three"):  # generation resumed (the balancer spreads these)
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert requests.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).ok

    # A bad delta (one tensor's post-apply digest wrong): refused before any write, on both replicas.
    newer = deltas.perturbed(sorted(deltas.base), seed=12, density=0.05)
    bad = deltas.fresh_dir("v2-bad")
    DC.write_delta(bad, new, newer, version=2)
    manifest = load_manifest(bad)
    name = manifest.params[0].name
    params = [
        p.model_copy(update={"post_digest": combine(p.post_digest, "0" * 31 + "1")}) if p.name == name else p
        for p in manifest.params
    ]
    write_manifest(bad, manifest.model_copy(update={"params": params}))
    r = requests.post(
        f"{server.url}/update_weights_delta",
        json={"path": bad.name, "version": 2, "base_version": 1},
        headers=headers,
        timeout=300,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "IntegrityError" and error["param"] == name, error
    assert set(error["ranks"]) == {"dp0:rank0", "dp1:rank0"}
    assert replica_checksums(server.url) == got, "a refused delta changed a replica's weights"
    status = requests.get(f"{server.url}/delta_updates/status", headers=headers, timeout=60).json()
    assert status["healthy"] and status["version"] == 1, status
    assert [(s["dp"], s["version"]) for s in status["replicas"]] == [(0, 1), (1, 1)]
    assert json.dumps(status)  # plain JSON all the way through
