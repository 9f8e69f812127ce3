"""`delta` as a vLLM weight-transfer backend, driven only through vLLM's own API.

One module, two engines (engine starts are the cost on 2 cores). The trainer's story is one
test, in phases that hand trainer states on (so it passes alone and in any order); the bad-input
test stands alone (the one-door refusal is a parse-time case in tests/engine/test_serve_parser.py):
1. `vllm serve <HF hub id> --weight-transfer-config '{"backend": "delta"}'`, configured from the
   environment only (no patch-only flag), the hub id resolved from a local HF cache offline. Its
   placement is learned and its kernels compiled at startup: the first sync compiles none (counted
   in the worker by a test-only worker extension). A plain PyTorch trainer syncs it for 3 steps
   through vLLM's `WeightTransferTrainerFactory`, `HTTPVLLMWeightSyncClient` and `ModuleSource`;
   `/metrics` and `weight_version` move each step.
   Then, while streams generate, a corrupt delta is refused and the next good ones apply, each
   prepared off the engine loop: tokens are generated during a prepare.
   Then bad input through vLLM's routes (its own test): the route's status, type and field, weights
   and greedy output untouched.
   Then 2 more steps over gloo, the engine joining the trainer's group through vLLM's init route,
   and one from a two-stage pipeline (two gloo trainer ranks, each sending the layers it holds).
2. The offline `LLM` with the same backend, fed the same trainer states (over disk); its backend's
   init compiles the kernels, so its first sync compiles none either.
3. The trainer's final weights, saved by transformers and loaded afresh by vLLM's own loader
   (harness/fresh_load): their digests equal both synced engines' `/weight_checker` digests.
4. A real commit fault on the served engine (the test-only fault armed at a version only this
   phase reaches), then an anchor of the checkpoint through a new vLLM session repairs it.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import requests
import torch
from harness import commit_fault, megatron_cpu, rl_frameworks
from harness.engine_pool import FAULT_AT, FAULT_VERSION, write_anchor
from harness.fresh_load import save_checkpoint
from harness.kernel_signatures import EXTENSION as KERNEL_SIGNATURES
from harness.trainer import Trainer
from harness.vllm_engine import VllmServer, patched_environ, start_llm
from native_helpers import (
    HUB_ID,
    NATIVE,
    Streams,
    checksums,
    hub_cache,
    merged_checksums,
    metric_samples,
    native_update,
    sample,
    save_trained,
    stage_names,
    ulp_step,
    write_delta,
)
from safetensors.torch import load_file
from vllm.distributed.weight_transfer import ParamMeta, WeightSource

from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
SERIES = ("decode_seconds", "apply_seconds", "pause_seconds", "bytes_read", "changed_elements")
PARAM = "model.layers.0.mlp.down_proj.weight"
STREAM_TOKENS = 240
UPDATES = 10
# The front end counts tokens as the engine's outputs reach it, so the step before a prepare can land
# after the count was read: one stream shows up to this many tokens even for a prepare on the engine
# loop (measured: at most 2 in 30 updates). More than this means the engine kept generating during it.
LAG_TOKENS = 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return Path(os.path.realpath(tmp_path_factory.mktemp("native_root")))


@pytest.fixture(scope="module")
def native_env(root) -> dict[str, str]:
    """What a plain `pip install` needs: the root, and our endpoint plugin allowlisted."""
    return {ROOT_ENV: str(root), "VLLM_PLUGINS": "delta_updates"}


@pytest.fixture(scope="module")
def served(model_dir, native_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native_serve")
    hub_cache(model_dir, tmp / "hf")
    env = {
        **native_env,
        "HF_HOME": str(tmp / "hf"),
        **commit_fault.engine_env(FAULT_VERSION, FAULT_AT),
    }  # phase 4
    args = [*NATIVE, "--worker-extension-cls", KERNEL_SIGNATURES]  # phase 1's count of compiled kernels
    with VllmServer(HUB_ID, tmp / "serve.log", extra_args=args, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def trainer(model_dir) -> Trainer:
    return Trainer(model_dir)


@pytest.fixture(scope="module")
def run() -> dict:
    """What the ordered tests hand on: trainer states per version, each engine's final digests."""
    return {"states": [], "digests": {}}


def status(url: str) -> dict:
    r = requests.get(f"{url}/delta_updates/status", timeout=60)
    r.raise_for_status()
    return r.json()


def kernel_signatures(url: str) -> list[dict[str, int]]:
    """Per worker, the signatures each kernel has compiled (harness/kernel_signatures.py)."""
    r = requests.post(f"{url}/collective_rpc", json={"method": "kernel_signatures"}, timeout=60)
    r.raise_for_status()
    return r.json()["results"]


def test_trainer_syncs_through_vllm_api_and_equals_a_fresh_engine(
    served, trainer, model_dir, root, run, tmp_path, tmp_path_factory, fresh_loader
):
    """Disk, gloo, a two-stage pipeline, then the offline `LLM` on the same states; a fresh load decides.
    Last, a real commit fault through the native door, repaired by an anchor of the checkpoint."""
    run["states"].clear()
    run.pop("held", None)
    run["states"].append(trainer.state())
    sync_over_disk(served, trainer, root, run)
    prepare_while_serving(served, trainer, root, run)
    sync_over_gloo(served, trainer, run)
    sync_from_pipeline_stages(served, root, run, tmp_path)
    replay_offline(trainer, model_dir, root, run)
    synced_equal_fresh_engine(trainer, model_dir, fresh_loader, run, tmp_path_factory)
    commit_fault_then_anchor(served, model_dir, root, run)


def sync_over_disk(served, trainer, root: Path, run: dict) -> None:
    """3 steps over disk through vLLM's trainer factory and HTTP client; metrics move each step."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_delta import DeltaTrainerInitInfo

    version = len(run["states"]) - 1
    deadline = time.monotonic() + 300
    while not (st := status(served.url))["placement"]["ready"] and time.monotonic() < deadline:
        time.sleep(0.5)  # the door's startup probe: placement, kernels, coverage across ranks
    assert st["version"] == version and st["placement"]["ready"], st
    compiled = kernel_signatures(served.url)
    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaTrainerInitInfo(delta_dir=str(root), flush_bytes=64 << 10, rank=0),
        client=HTTPVLLMWeightSyncClient(served.url),
        source=ModuleSource(trainer.model),
    )
    before = run["digests"]["checkpoint"] = checksums(served.url)
    for step in range(version + 1, version + 4):
        m0 = metric_samples(served.url)
        trainer.step()
        metrics = engine.send_weights()
        run["states"].append(trainer.state())
        assert metrics["sender/all_acked"] == 1.0 and metrics["sender/changed_elements"] > 0, (
            engine.sender.engines
        )
        st = status(served.url)
        assert st["version"] == step and st["weight_version"] == str(step) and st["healthy"], st
        if step == version + 1:  # the first sync after startup compiled no kernel
            assert kernel_signatures(served.url) == compiled
        assert requests.get(f"{served.url}/weight_info", timeout=30).json()["weight_version"] == str(step)
        m1 = metric_samples(served.url)
        assert sample(m1, "vllm_delta:weights_version") == step
        for name in SERIES:
            assert sample(m1, f"vllm_delta:{name}_count") == sample(m0, f"vllm_delta:{name}_count") + 1, name
        moved = sample(m1, "vllm_delta:changed_elements_sum") - sample(m0, "vllm_delta:changed_elements_sum")
        assert moved == st["last"]["changed"] > 0
        assert all(isinstance(st["last"][key], float) for key in ("pause_s", "apply_s")), (
            st
        )  # reported, not judged
        assert requests.get(f"{served.url}/is_paused", timeout=30).json()["is_paused"] is False
        assert served.complete("The quick brown fox", max_tokens=4)["text"]
    engine.shutdown()
    run["digests"]["serve"] = checksums(served.url)
    assert run["digests"]["serve"] != before
    assert not list(root.glob("v*")), "delivered version directories are removed"


def prepare_while_serving(served, trainer, root: Path, run: dict) -> None:
    """The native door prepares off the engine loop. While greedy streams run back to back: a corrupt
    delta is refused (400, naming its file) with the weights untouched and vLLM's session ended, then
    up to `UPDATES` deltas moving 50% of every tensor apply through vLLM's routes, and vLLM's
    `generation_tokens` counter moves by more than `LAG_TOKENS` during at least one prepare (one
    takes tens of ms here, which a loaded machine may fill with few tokens)."""
    version = len(run["states"]) - 1
    chain, weights = [], run["states"][-1]
    for step in range(1, UPDATES + 1):  # written up front: the updates follow each other closely
        new, gen = {n: t.clone() for n, t in weights.items()}, torch.Generator().manual_seed(step)
        for t in new.values():
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.shape, generator=gen) < 0.5] += 1
        chain.append(
            (write_delta(root, f"serving{step}", new, weights, version + step, version + step - 1), new)
        )
        weights = new
    corrupt = root / "serving-corrupt"
    shutil.copytree(chain[0][0], corrupt)
    flush = next(corrupt.glob("*.safetensors"))
    data = bytearray(flush.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flush.write_bytes(bytes(data))
    digests, seen = checksums(served.url), []
    with Streams(served.url, STREAM_TOKENS) as streams:
        r, _ = native_update(
            served.url,
            {"path": corrupt.name, "version": version + 1, "base_version": version},
            str(version + 1),
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "IntegrityError", r.text
        assert r.json()["error"]["file"] == flush.name, r.text
        assert checksums(served.url) == digests, "a refused update changed the weights"
        for step, (path, new) in enumerate(chain, 1):
            r, done = native_update(
                served.url,
                {"path": path.name, "version": version + step, "base_version": version + step - 1},
                str(version + step),
            )
            assert r.status_code == 200 and done is not None, r.text
            run["states"].append(new)
            assert r.json()["tokens_during_prepare"] == done["tokens_during_prepare"], (r.json(), done)
            seen.append(done["tokens_during_prepare"])
            print(
                f"native prepare_s={done['prepare_s']:.3f} pause_s={done['pause_s']:.3f} "
                f"tokens_during_prepare={seen[-1]} changed={done['changed']}"
            )
            if seen[-1] > LAG_TOKENS:
                break
    assert max(seen) > LAG_TOKENS, seen  # vLLM's generation_tokens counter moved during a native prepare
    assert streams.counts and all(c == STREAM_TOKENS for c in streams.counts), streams.counts
    st = status(served.url)
    assert st["version"] == len(run["states"]) - 1 and st["healthy"], st
    assert requests.get(f"{served.url}/is_paused", timeout=30).json()["is_paused"] is False
    trainer.model.load_state_dict(run["states"][-1])  # the next phase's trainer starts from what is served
    for path, _ in chain:
        shutil.rmtree(path)
    shutil.rmtree(corrupt)


def commit_fault_then_anchor(served, model_dir: Path, root: Path, run: dict) -> None:
    """A commit that fails for real part-way (the armed test fault): 500 naming the tensor, generation
    stays paused and the engine unhealthy; vLLM's update session is closed all the same (vLLM 0.32's
    finish would leave it open had ours raised), so a full anchor of the checkpoint can start one
    and repair it."""
    version = status(served.url)["version"]
    new = {n: t.clone() for n, t in run["states"][-1].items()}
    ulp_step(new, seed=version)
    path = write_delta(root, "fault", new, run["states"][-1], FAULT_VERSION, version)
    assert requests.post(f"{served.url}/start_weight_update", timeout=60).status_code == 200
    r = requests.post(
        f"{served.url}/update_weights",
        json={"update_info": {"path": path.name, "version": FAULT_VERSION, "base_version": version}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    r = requests.post(f"{served.url}/finish_weight_update", json={"weight_version": "fault"}, timeout=300)
    assert r.status_code == 500 and FAULT_AT in r.json()["error"]["message"], r.text
    assert not status(served.url)["healthy"]
    assert requests.get(f"{served.url}/is_paused", timeout=30).json()["is_paused"] is True
    checkpoint = load_file(model_dir / "model.safetensors")
    anchor = write_anchor(root / "anchor", checkpoint.items(), FAULT_VERSION + 1)
    r, done = native_update(served.url, {"path": anchor.name, "version": FAULT_VERSION + 1}, "anchored")
    assert r.status_code == 200 and done is not None, r.text
    st = status(served.url)
    assert st["healthy"] and st["version"] == FAULT_VERSION + 1 and st["weight_version"] == "anchored", st
    assert requests.get(f"{served.url}/is_paused", timeout=30).json()["is_paused"] is False
    assert checksums(served.url) == run["digests"]["checkpoint"]
    run["held"] = (FAULT_VERSION + 1, checkpoint)
    for d in (path, anchor):
        shutil.rmtree(d)


def greedy(server) -> tuple[list[int], list[float]]:
    """Greedy token ids and logprobs; a fresh cache salt, so each call computes the prompt afresh."""
    out = server.complete(
        "The quick brown fox",
        max_tokens=4,
        ignore_eos=True,
        return_token_ids=True,
        cache_salt=uuid.uuid4().hex,
    )
    return out["token_ids"], out["logprobs"]["token_logprobs"]


def test_bad_input_through_native_routes(served, model_dir, root, run):
    """Each case breaks one field of an otherwise valid delta (written against the weights the engine
    holds, at the next version); every refusal names its type and field, is counted once under its
    status, and leaves the weights and the greedy tokens and logprobs as they were."""
    before = status(served.url)
    version = before["version"]
    # What the engine holds: the scenario's last (version, weights), or the checkpoint before any sync.
    held_version, held = run.get("held") or (0, load_file(model_dir / "model.safetensors"))
    assert version == held_version, (version, held_version)
    v, base = version + 1, version
    new = held[PARAM].clone()
    new.view(-1).view(torch.int16)[::7] += 1
    good = write_delta(root, "good", {PARAM: new}, held, v, base)
    unknown = write_delta(
        root,
        "unknown",
        {"model.layers.0.mlp.nope.weight": new},
        {"model.layers.0.mlp.nope.weight": held[PARAM]},
        v,
        base,
    )
    reshaped = write_delta(
        root,
        "reshaped",
        {PARAM: new.reshape(-1)[:64].reshape(8, 8)},
        {PARAM: held[PARAM].reshape(-1)[:64].reshape(8, 8)},
        v,
        base,
    )
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    flush = next(corrupt.glob("*.safetensors"))
    data = bytearray(flush.read_bytes())
    data[-1] ^= 0xFF
    flush.write_bytes(bytes(data))
    elsewhere = root.parent / f"{root.name}-elsewhere"  # the same valid delta, outside the root
    shutil.copytree(good, elsewhere)
    cases = [  # update_info, status, error type, (the field it names, its value)
        ({"path": good.name, "version": v + 1, "base_version": base + 1}, 409, "VersionError", None),
        ({"path": good.name, "version": base, "base_version": base}, 409, "VersionError", None),
        ({"path": f"../{elsewhere.name}", "version": v, "base_version": base}, 403, "PathOutsideRoot", None),
        (
            {"path": good.name, "version": "four", "base_version": base},
            400,
            "InvalidRequest",
            ("message", "version: "),
        ),
        (
            {"path": unknown.name, "version": v, "base_version": base},
            422,
            "UnknownParamError",
            ("param", "model.layers.0.mlp.nope.weight"),
        ),
        (
            {"path": reshaped.name, "version": v, "base_version": base},
            422,
            "ShapeMismatchError",
            ("param", PARAM),
        ),
        (
            {"path": corrupt.name, "version": v, "base_version": base},
            400,
            "IntegrityError",
            ("file", flush.name),
        ),
    ]
    digests, output, m0 = checksums(served.url), greedy(served), metric_samples(served.url)
    for update_info, code, kind, field in cases:
        assert requests.post(f"{served.url}/start_weight_update", timeout=60).status_code == 200
        r = requests.post(f"{served.url}/update_weights", json={"update_info": update_info}, timeout=120)
        assert r.status_code == code, (update_info, r.text)
        error = r.json()["error"]
        assert error["type"] == kind, (update_info, error)
        if field is not None and field[0] == "message":
            assert error["message"].startswith(field[1]), (update_info, error)
        elif field is not None:
            assert error[field[0]] == field[1], (update_info, error)
    r = requests.post(f"{served.url}/update_weights", data=b"{not json", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidRequest", r.text
    assert r.json()["error"]["message"].startswith("body: "), r.text
    assert checksums(served.url) == digests, "a refused update changed the weights"
    st = status(served.url)
    assert st["version"] == version and st["weight_version"] == before["weight_version"] and st["healthy"], st
    m1 = metric_samples(served.url)
    counts = Counter([code for _, code, _, _ in cases] + [400])  # + the body that is not JSON
    for code, count in counts.items():
        assert (
            sample(m1, "vllm_delta:update_failures_total", status=str(code))
            == sample(m0, "vllm_delta:update_failures_total", status=str(code)) + count
        ), code
    assert greedy(served) == output, "a refused update changed the served output"
    for d in (good, unknown, reshaped, corrupt, elsewhere):
        shutil.rmtree(d)


def sync_over_gloo(served, trainer, run: dict) -> None:
    """`transport="gloo"`: the engine joins the trainer's group through vLLM's init route; 2 more steps."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_delta import DeltaTrainerInitInfo

    version = len(run["states"]) - 1
    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaTrainerInitInfo(
            transport="gloo", version=version, flush_bytes=64 << 10, collective_timeout_s=60, rank=0
        ),
        client=HTTPVLLMWeightSyncClient(served.url),
        source=ModuleSource(trainer.model),
    )
    for step in range(version + 1, version + 3):
        trainer.step()
        metrics = engine.send_weights()
        run["states"].append(trainer.state())
        assert metrics["sender/all_acked"] == 1.0, engine.sender.engines
        st = status(served.url)
        assert st["version"] == step and st["weight_version"] == str(step) and st["healthy"], st
    engine.shutdown()
    run["digests"]["serve"] = checksums(served.url)


class StageSource(WeightSource):
    """A pipeline stage's `WeightSource`: metadata for the whole model, tensors for its own layers only."""

    def __init__(self, full: dict[str, torch.Tensor], held: set[str]) -> None:
        self.full, self.held = full, held

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.full.items()]

    def __iter__(self):
        for name, t in self.full.items():
            yield name, (t if name in self.held else None)

    def held_names(self) -> set[str]:
        return self.held


def _stage(rank: int, world_size: int, port: int, url: str, root: str, state_file: str, version: int) -> None:
    """One trainer rank of a two-stage pipeline: it sends only what it holds; rank 0 talks to the engine."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from vllm_delta import DeltaTrainerInitInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    full = torch.load(state_file)
    source = StageSource(full, stage_names(list(full), rank))
    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaTrainerInitInfo(delta_dir=root, version=version, group=dist.group.WORLD, rank=rank),
        client=HTTPVLLMWeightSyncClient(url),
        source=source,
    )
    ulp_step(full, seed=version)
    metrics = engine.send_weights()
    assert metrics["sender/all_acked"] == 1.0, metrics
    engine.shutdown()
    dist.destroy_process_group()


def sync_from_pipeline_stages(served, root: Path, run: dict, tmp_path: Path) -> None:
    """`held_names`: two trainer ranks (gloo), each holding half the layers, make one version."""
    version = len(run["states"]) - 1
    state = {n: t.clone() for n, t in run["states"][-1].items()}
    torch.save(state, tmp_path / "state.pt")
    megatron_cpu.spawn(_stage, 2, served.url, str(root), str(tmp_path / "state.pt"), version, timeout=240)
    ulp_step(state, seed=version)
    run["states"].append(state)
    st = status(served.url)
    assert st["version"] == version + 1 and st["weight_version"] == str(version + 1) and st["healthy"], st
    run["digests"]["serve"] = checksums(served.url)


def replay_offline(trainer, model_dir: Path, root: Path, run: dict) -> None:
    """The same trainer states through the offline `LLM` methods; the snapshot seeded from the checkpoint."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_delta import DeltaTrainerInitInfo
    from vllm_delta.weight_transfer.trainer import OfflineLLMClient

    states = run["states"]
    trainer.model.load_state_dict(states[0])
    with (
        patched_environ({ROOT_ENV: str(root)}),
        start_llm(
            model_dir, weight_transfer_config={"backend": "delta"}, worker_extension_cls=KERNEL_SIGNATURES
        ) as llm,
    ):
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(delta_dir=str(root), checkpoint=str(model_dir), rank=0),
            client=OfflineLLMClient(llm),
            source=ModuleSource(trainer.model),
        )
        compiled = llm.collective_rpc("kernel_signatures")  # after the backend's init
        for step, state in enumerate(states[1:], 1):
            trainer.model.load_state_dict(state)
            metrics = engine.send_weights()
            assert metrics["sender/all_acked"] == 1.0, engine.sender.engines
            assert llm.get_weight_version() == str(step)
            if step == 1:
                assert llm.collective_rpc("kernel_signatures") == compiled
        engine.shutdown()
        llm.start_weight_update()
        with pytest.raises(Exception, match="PathOutsideRoot"):
            llm.update_weights({"update_info": {"path": "../elsewhere", "version": 4, "base_version": 3}})
        run["digests"]["offline"] = merged_checksums(llm.collective_rpc("compute_weight_checksums"))


def synced_equal_fresh_engine(trainer, model_dir: Path, fresh_loader, run: dict, tmp_path_factory) -> None:
    """Independent of our code: transformers writes the weights, vLLM loads them and digests them."""
    trainer.model.load_state_dict(run["states"][-1])
    out = save_trained(trainer.model, model_dir, tmp_path_factory.mktemp("trained"))
    # vLLM's own loader, in a process of its own, configured as a delta engine: like the `delta` backend,
    # it keeps CPU linear layers' full weights where /weight_checker sees them (harness/fresh_load).
    fresh_digests = fresh_loader.checksums(out)
    assert run["digests"]["serve"] == fresh_digests
    assert run["digests"]["offline"] == fresh_digests


def test_the_backend_refuses_a_worker_that_also_has_our_extension():
    """The offline `LLM(worker_extension_cls=..., weight_transfer_config={"backend": "delta"})` path, which
    no command-line parser sees: the worker refuses before it holds any state."""
    from types import SimpleNamespace

    from vllm_delta.engine.cli_args import WORKER_EXTENSION
    from vllm_delta.weight_transfer.worker_engine import DeltaWeightTransferEngine

    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=WORKER_EXTENSION))
    with pytest.raises(ValueError, match="cannot serve the same engine: choose one"):
        DeltaWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Module())


def test_the_backend_refuses_eplb():
    """EPLB moves experts between slots at run time, so the placement learned at startup would go stale:
    the worker refuses before it holds any state (the CLI door refuses --enable-eplb at parse time)."""
    from types import SimpleNamespace

    from vllm_delta.weight_transfer.worker_engine import DeltaWeightTransferEngine

    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=None, enable_eplb=True))
    with pytest.raises(ValueError, match="cannot run with --enable-eplb"):
        DeltaWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Module())


@rl_frameworks.installed
def test_skyrl_client_and_source_drive_our_trainer_engine(served, model_dir, root, fresh_loader, tmp_path):
    """SkyRL 0.4.0's own `SkyrlWeightSyncClient` and `FsdpWeightSource`, unchanged (from its wheel, as
    `make install` puts it: harness/rl_frameworks.py), drive our trainer engine
    (vllm_delta/integrations/skyrl.py) through vLLM's trainer factory: two syncs, then the served
    weights equal a fresh load of the trainer's export."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_delta.integrations.skyrl import SkyrlDeltaInitInfo, register_trainer_engine

    control, sources = (
        rl_frameworks.skyrl_module("control_plane.py"),
        rl_frameworks.skyrl_module("sources.py"),
    )
    register_trainer_engine()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    client = control.SkyrlWeightSyncClient([served.url], 1)
    engine = WeightTransferTrainerFactory.trainer_init(
        SkyrlDeltaInitInfo(
            delta_dir=str(root), checkpoint=str(model_dir), version=status(served.url)["version"], rank=0
        ),
        client=client,
        source=sources.FsdpWeightSource(model, torch.bfloat16),
    )
    assert engine.skyrl_handles_prefix_cache_reset is False  # SkyRL's worker reads it off every engine
    metrics = []
    for step in (1, 2):
        gen = torch.Generator().manual_seed(10 + step)
        with torch.no_grad():
            for p in model.parameters():
                bits = p.view(-1).view(torch.int16)
                bits[torch.rand(bits.shape, generator=gen) < 0.02] += 1
        metrics.append(engine.send_weights())
    engine.shutdown()
    client.close()
    assert len(metrics) == 2, metrics
    weights = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
    export = save_checkpoint(weights, like=model_dir, out=tmp_path / "export")
    assert checksums(served.url) == fresh_loader.checksums(export), metrics
