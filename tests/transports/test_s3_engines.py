"""Real `vllm serve` engines pulling deltas from a real local S3 store (moto, in this process).

Engines on `--delta-updates-root s3://BUCKET/PREFIX` and a plain PyTorch trainer syncing after every
step through `DeltaSender(transport="s3")`. After every sync each engine's `/weight_checker` digests
must equal a fresh load, by vLLM's own loader, of the weights the trainer saves (harness/fresh_load).
The trainer's upload bytes per sync must equal the bytes of that one version's objects in the store,
listed by a plain boto3 client, with 1 engine and with 2. Engine a syncs alone first; then engine b
starts on its checkpoint (version 0), a late joiner: it catches up from the versions kept in the store
(no new anchor is uploaded) and is exact. The engines take only manifests signed with their key (the
sender signs every one), so the kept chain replays signed too; last, a sender with another key and one
with none write their own versions into the bucket: both are refused (403) and change nothing. One
scenario in phases, so two engine starts serve all of it: b starts once, when it is late (it used to
start with a, stop, and start again; the sender's `remove_engine` is pinned in test_s3_planner).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.fresh_load import save_checkpoint
from harness.s3_server import prefix_of
from harness.store_engine import engine_checksums, engine_status
from harness.trainer import Trainer
from harness.vllm_engine import VllmServer, patched_environ

from vllm_delta import DeltaSender

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

API_KEY = "s3-engine-key"
SIGNING_KEY = "s3-engines-signing-key-0123456789"


def start_engine(model_dir: Path, url: str, env: dict[str, str], log: Path) -> VllmServer:
    return VllmServer(
        model_dir,
        log,
        env=env,
        extra_args=[
            "--enable-delta-updates",
            "--delta-updates-root",
            url,
            "--api-key",
            API_KEY,
            "--delta-updates-signing-key",
            SIGNING_KEY,
        ],
    )


def version_bytes(server, url: str, version: int) -> int:
    """What the store holds for one version (its flushes and manifest), by a plain boto3 listing."""
    sizes = server.sizes(f"{prefix_of(url)}/v{version:06d}/")
    assert sizes, f"v{version:06d} is not in the store"
    return sum(sizes.values())


def test_two_engines_and_a_late_joiner_sync_exactly_through_the_store(
    s3_server, tiny_model_factory, fresh_loader, tmp_path
):
    model_dir = tiny_model_factory("llama")
    url = s3_server.url("engines")
    env = s3_server.env()
    base = fresh_loader.checksums(model_dir)
    a = start_engine(model_dir, url, env, tmp_path / "a.log")
    b = None
    try:
        trainer = Trainer(model_dir)
        with patched_environ(env):  # the sender reads the standard AWS environment
            sender = DeltaSender(
                [a.url], "s3", url, api_key=API_KEY, flush_bytes=64 << 10, signing_keys=[SIGNING_KEY]
            )
        sender.seed(trainer.weights())

        def sync_and_check(engines: list[VllmServer], version: int) -> dict[str, float]:
            trainer.step()
            m = sender.sync(trainer.weights())
            assert m["sender/all_acked"] == 1.0, sender.engines
            want = fresh_loader.checksums(
                save_checkpoint(trainer.state(), model_dir, tmp_path / f"step{version}")
            )
            assert want != base, "the trainer moved away from the checkpoint"
            for e in engines:
                assert engine_status(e.url, API_KEY)["version"] == version
                assert engine_checksums(e.url, API_KEY) == want, (
                    f"{e.url} differs from a fresh load at v{version}"
                )
            return m

        # One engine, two syncs: one version's bytes each.
        for version in (1, 2):
            m = sync_and_check([a], version)
            assert m["perf/update_weights_upload_bytes"] == version_bytes(s3_server, url, version)

        # b starts on its checkpoint (version 0): a late joiner, caught up from the store's kept versions.
        b = start_engine(model_dir, url, env, tmp_path / "b.log")
        assert engine_status(b.url, API_KEY)["version"] == 0
        sender.add_engine(b.url)
        m = sync_and_check([a, b], 3)
        assert m["sender/anchors"] == 0.0, "b replayed the kept chain; no anchor was sent"
        assert m["perf/update_weights_upload_bytes"] == version_bytes(s3_server, url, 3), (
            "only v3 was uploaded"
        )

        # Two engines, three syncs (v3 above): one upload per sync, whatever the number of engines.
        for version in (4, 5):
            m = sync_and_check([a, b], version)
            assert m["perf/update_weights_upload_bytes"] == version_bytes(s3_server, url, version)
        sender.close()

        # Writers of the bucket without the engines' key: their manifests are refused before any flush
        # is fetched, and the engines keep the trainer's weights.
        held = {e.url: engine_checksums(e.url, API_KEY) for e in (a, b)}
        for keys, error in ((["another-key-of-someone-0123456789"], "not one of"), ([], "not signed")):
            with patched_environ(env):
                forger = DeltaSender([a.url, b.url], "s3", url, api_key=API_KEY, version=5, signing_keys=keys)
            forger.seed(trainer.weights())
            trainer.step()
            forger.sync(trainer.weights())
            for e in (a, b):
                state = forger.engines[e.url]
                assert state.last_status == 403 and state.last_error["type"] == "SignatureError", state
                assert error in state.last_error["message"], state.last_error
                assert engine_checksums(e.url, API_KEY) == held[e.url]
                assert engine_status(e.url, API_KEY)["version"] == 5
            forger.close()
    finally:
        a.stop()
        if b is not None:
            b.stop()
