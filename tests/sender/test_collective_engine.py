"""The collective (gloo) transport against two real `vllm serve --enable-delta-updates` engines.

The engines are the session's engine pair (harness/engine_pair.py, shared with other modules), put
back on the checkpoint when this module starts. Both take at most CAP bytes per flush (the engine's
per-flush cap), so a whole-model anchor streams as many flushes; there is no total cap. Each test starts
from engines that hold the module trainer's weights and leaves them so (an engine a test knocks off is
restarted through the pair and anchored back), so every test runs alone or in any order. Bit-exactness
is checked against a fresh load of the trainer's weights by vLLM's own loader (`/weight_checker`
digests, harness/fresh_load), besides each update's own post-apply hashes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from harness import megatron_cpu
from harness.engine_pair import COLLECTIVE_FLUSH_CAP as CAP
from harness.engine_pair import EnginePair
from harness.engine_pool import API_KEY
from harness.fresh_load import save_checkpoint
from harness.trainer import Trainer
from sender_helpers import adam_like_step, engine_checksums, engine_status

from vllm_delta import DeltaSender
from vllm_delta.transports import collective

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
FLUSH = 16 << 10  # the sender's flush target, under the engines' per-flush cap


@pytest.fixture(scope="module")
def model_dir(engine_pair: EnginePair) -> Path:
    return engine_pair.model_dir


@pytest.fixture(scope="module")
def engines(engine_pair: EnginePair):
    """The pair's two engines on the checkpoint (the pair's list: a test that restarts one through the
    pair finds the new one in its place)."""
    return engine_pair.on_checkpoint()


@pytest.fixture(scope="module")
def base_digests(model_dir, fresh_loader) -> dict[str, str]:
    """The checkpoint's digests, loaded by vLLM alone."""
    return fresh_loader.checksums(model_dir)


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


def test_two_engines_sync_concurrently(engines, trainer, base_digests):
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
    assert checksums(a) == checksums(b) != base_digests
    sender.close()


def test_refusal_leaves_that_engine_unchanged_and_updates_the_other(engine_pair, engines, trainer):
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
        [b.url],
        "disk",
        engine_pair.root,
        api_key=API_KEY,
        flush_bytes=FLUSH,
        version=int(m["sender/version"]),
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
    engine_pair, engines, trainer, model_dir, fresh_loader, tmp_path, monkeypatch
):
    """b is SIGKILLed after its first flush: the sender survives, a is updated on its own group and has
    the digests of a fresh load of the trainer's weights; b, restarted on the same port (on the
    checkpoint, at version 0), is anchored by the next sync and both end on the trainer's weights."""
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

    want = fresh_loader.checksums(save_checkpoint(trainer.state(), model_dir, tmp_path / "trained"))
    assert checksums(a) == want, "the synced engine equals a fresh load of the trainer's weights"
    b = engine_pair.restart(1)  # the pair's list now holds it: the modules after this one find a pair
    assert status(b)["version"] == 0

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
