"""The collective (gloo) transport against two real `vllm serve --enable-delta-updates` engines.

Both engines take at most CAP bytes per flush (the engine's per-flush cap), so a whole-model anchor
streams as many flushes; there is no total cap. Each test starts from engines that hold the module
trainer's weights and leaves them so (an engine a test knocks off is anchored back), so every test
runs alone or in any order. Bit-exactness is checked against a fresh engine loaded from the
trainer's weights (`/weight_checker` digests), besides each update's own post-apply hashes.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from unittest import mock

import harness.vllm_engine as vllm_engine
import pytest
import torch
from harness import megatron_cpu
from harness.trainer import Trainer
from harness.vllm_engine import VllmServer, start_servers
from sender_helpers import adam_like_step, engine_checksums, engine_status

from vllm_delta import DeltaSender, settings
from vllm_delta.transports import collective

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
API_KEY = "collective-test-key"
CAP = 64 << 10  # each engine's per-flush cap
FLUSH = 16 << 10  # the sender's flush target, under the cap


def serve(model_dir: Path, log: Path) -> VllmServer:
    args = [
        "--enable-delta-updates",
        "--delta-updates-root",
        str(log.parent),
        "--api-key",
        API_KEY,
        "--delta-updates-collective-trainers",
        "127.0.0.1",
    ]
    server = VllmServer(model_dir, log, extra_args=args, env={settings.COLLECTIVE_MAX_FLUSH_BYTES: str(CAP)})
    server.root = log.parent
    return server


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """Two engines (a list, so a test that restarts one can put the new one in its place)."""
    servers: list[VllmServer] = []
    try:
        logs = [tmp_path_factory.mktemp(f"engine_{name}") / "serve.log" for name in ("a", "b")]
        servers = start_servers(*(lambda log=log: serve(model_dir, log) for log in logs))
        servers[0].base_digests = engine_checksums(servers[0].url, API_KEY)  # the checkpoint's
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def trainer(model_dir) -> Trainer:
    return Trainer(model_dir)


def status(server) -> dict:
    return engine_status(server.url, API_KEY)


def checksums(server) -> dict[str, str]:
    return engine_checksums(server.url, API_KEY)


def sender_for(servers, **kwargs) -> DeltaSender:
    """A gloo sender that resumes the engines' run at their version (they hold the trainer's weights)."""
    version = max(status(s)["version"] for s in servers)
    return DeltaSender(
        [s.url for s in servers],
        "gloo",
        api_key=API_KEY,
        flush_bytes=FLUSH,
        version=version,
        collective_timeout_s=60,
        max_pending_density=1.0,
        **kwargs,
    )


def every_engine_acked(sender: DeltaSender, m: dict) -> bool:
    """Every engine holds the sync's version (`all_acked` counts only engines not owed an anchor)."""
    return m["sender/all_acked"] == 1.0 and all(
        e.acked == m["sender/version"] for e in sender.engines.values()
    )


def until_acked(sender: DeltaSender, trainer: Trainer, tries: int = 3) -> list[dict]:
    """Sync until every engine acked (an engine outside the lineage is anchored on a later sync)."""
    ms = [sender.sync(trainer.weights())]
    while not every_engine_acked(sender, ms[-1]) and len(ms) < tries:
        ms.append(sender.sync(trainer.weights()))
    assert every_engine_acked(sender, ms[-1]), sender.engines
    return ms


def save_weights(model_dir: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    from safetensors.torch import save_file

    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, out / "model.safetensors")
    return out


def test_two_engines_sync_concurrently(engines, trainer):
    a, b = engines
    sender = sender_for(engines)
    sender.seed(trainer.weights())
    start = status(a)["version"]
    for step in range(1, 3):
        trainer.step()
        m = sender.sync(trainer.weights())
        assert m["sender/all_acked"] == 1.0, sender.engines
        assert status(a)["version"] == status(b)["version"] == start + step
        links = [sender.transport.link(s.url, None) for s in engines]
        assert all(link.group is not None and link.bytes_sent > 0 for link in links)  # kept for the next sync
    assert checksums(a) == checksums(b) != a.base_digests
    sender.close()


def test_refusal_leaves_that_engine_unchanged_and_updates_the_other(engines, trainer):
    """Engine b moves on behind the sender's back (another sender of the same run writes other weights
    into it at the next version, over disk, so the sender's group to b stays up): the sender's next
    delta is outside b's lineage, b refuses it in the handshake, no bulk byte goes to b, a is updated
    on its own group, and an anchor then puts b back on the trainer's weights."""
    a, b = engines
    sender = sender_for(engines)
    sender.seed(trainer.weights())
    trainer.step()
    m = sender.sync(trainer.weights())
    assert every_engine_acked(sender, m), sender.engines
    other = DeltaSender(
        [b.url], "disk", b.root, api_key=API_KEY, flush_bytes=FLUSH, version=int(m["sender/version"])
    )
    other.seed(trainer.weights())
    foreign = dict(trainer.state())
    adam_like_step(foreign, torch.Generator().manual_seed(7))
    assert every_engine_acked(other, other.sync(foreign.items())), other.engines
    other.close()
    b_before, b_version = checksums(b), status(b)["version"]

    trainer.step()
    m = sender.sync(trainer.weights())
    assert sender.engines[a.url].last_status == 200 and sender.engines[b.url].last_status == 409
    assert sender.engines[a.url].acked == m["sender/version"] and sender.engines[b.url].acked is None
    refusal = sender.transport.link(b.url, None).refusal
    assert (refusal["status"], refusal["type"]) == (409, "VersionError"), refusal  # the base-version check
    assert "base_version" in refusal["message"], refusal
    assert (
        sender.transport.link(b.url, None).bytes_sent == 0
        and sender.transport.link(b.url, None).group is None
    )
    assert sender.transport.link(a.url, None).group is not None  # a's group was not torn down
    assert checksums(b) == b_before and status(b)["version"] == b_version and status(b)["healthy"]
    a_synced = checksums(a)

    sender.request_anchor()  # b's version is one this run also used: only an anchor proves its weights
    until_acked(sender, trainer)
    assert checksums(b) == checksums(a) == a_synced
    sender.close()


def test_flush_over_the_engine_cap_is_refused_before_any_byte_moves(engines, trainer):
    a, _ = engines
    sender = sender_for([a], anchor_every=1)  # every sync a whole-model anchor, in flushes over CAP
    sender.seed(trainer.weights())
    sender.publisher.flush_bytes = 16 * CAP
    before, version = checksums(a), status(a)["version"]
    trainer.step()
    m = sender.sync(trainer.weights())
    link = sender.transport.link(a.url, None)
    assert m["sender/all_acked"] == 0.0 and sender.engines[a.url].last_status == 400
    assert link.refusal["type"] == "LimitError" and link.refusal["file"].startswith("rank0000_flush"), (
        link.refusal
    )
    assert link.bytes_sent == 0
    assert checksums(a) == before and status(a)["version"] == version
    sender.publisher.flush_bytes = FLUSH  # the same anchor in flushes under the cap streams
    ms = until_acked(sender, trainer)
    assert ms[-1]["perf/update_weights_wire_bytes"] > 4 * CAP, "the anchor is several times the per-flush cap"
    sender.close()


def test_engine_killed_mid_broadcast_tears_down_only_its_group(
    engines, trainer, model_dir, tmp_path, monkeypatch
):
    """b is SIGKILLed after its first flush: the sender survives, a is updated on its own group, and
    b, restarted on the same port from the trainer's weights (a fresh load), has a's digests; the
    next sync anchors b (a fresh engine at version 0) and both end on the trainer's weights."""
    a, b = engines
    sender = sender_for(engines)
    sender.seed(trainer.weights())
    real_stream = collective.stream
    killed = []

    def stream(group, flushes):
        if group is not sender.transport.link(b.url, None).group:
            return real_stream(group, flushes)
        for i, data in enumerate(flushes):
            group.send_bytes(data)
            if i == 0:
                os.killpg(b.proc.pid, signal.SIGKILL)
                b.proc.wait()
                killed.append(True)

    monkeypatch.setattr(collective, "stream", stream)
    trainer.step()
    m = sender.sync(trainer.weights())
    monkeypatch.setattr(collective, "stream", real_stream)
    assert (
        killed and sender.engines[b.url].acked is None and sender.engines[a.url].acked == m["sender/version"]
    )
    assert sender.engines[a.url].last_status == 200 and sender.engines[b.url].last_status != 200
    assert sender.transport.link(b.url, None).group is None
    assert sender.transport.link(a.url, None).group is not None

    out = save_weights(model_dir, trainer.state(), tmp_path)
    with mock.patch.object(vllm_engine, "free_port", return_value=b.port):
        engines[1] = b = serve(out, tmp_path / "restarted.log")
    assert checksums(b) == checksums(a), "the synced engine equals a fresh load of the trainer's weights"

    trainer.step()
    ms = until_acked(sender, trainer)
    assert any(m["sender/anchors"] >= 1 for m in ms)
    assert checksums(b) == checksums(a)
    sender.close()


def _sharded_sender(
    rank: int, world: int, port: int, url: str, state_file: str, version: int, out: str
) -> None:
    """One of two trainer ranks: it holds every other tensor and sends what changed in them to rank 0,
    which broadcasts to the engine."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the sender's own group (vllm_delta/sender/ranks.py)
    full = torch.load(state_file)
    mine = {n: full[n] for n in sorted(full)[rank::world]}
    sender = DeltaSender(
        [url],
        "gloo",
        api_key=API_KEY,
        flush_bytes=FLUSH,
        version=version,
        group=group,
        collective_timeout_s=60,
        max_pending_density=1.0,
    )
    sender.seed(mine)
    adam_like_step(mine, torch.Generator().manual_seed(100 + rank), density=0.05)
    m = sender.sync(mine)
    assert m["sender/all_acked"] == 1.0, sender.engines
    torch.save(mine, f"{out}.{rank}")
    sender.close()
    dist.destroy_process_group()


def test_two_sender_ranks_with_different_shards(engines, trainer, tmp_path):
    """Megatron-style: two gloo sender ranks hold different tensors; only their encoded changes go to
    rank 0 and on to engine a. Engine b gets the same weights from a one-rank sender: equal digests."""
    a, b = engines
    version = status(a)["version"]
    torch.save(trainer.state(), tmp_path / "state.pt")
    megatron_cpu.spawn(
        _sharded_sender, 2, a.url, str(tmp_path / "state.pt"), version, str(tmp_path / "out"), timeout=300
    )
    new = {**torch.load(tmp_path / "out.0"), **torch.load(tmp_path / "out.1")}
    assert status(a)["version"] == version + 1
    with torch.no_grad():
        params = dict(trainer.model.state_dict())
        for n, t in new.items():
            params[n].copy_(t)
    single = sender_for([b])
    single.seed(torch.load(tmp_path / "state.pt").items())
    until_acked(single, trainer)
    assert checksums(a) == checksums(b)
    single.close()
