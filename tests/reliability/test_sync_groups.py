"""A sync never stops training, across process groups (issue 18 item 6; the harness is
test_sync_never_stops.py's):

- a gloo peer that joins the group's store and never sets up the bulk channel (a real engine
  process answering the collective init route as an engine rank that went away would);
- a two-rank sender whose rank 1 fails while encoding (the one injected fault: a rank's own local
  failure has no cheaper real cause): both ranks record it at the same sync, neither is left in a
  collective, and the next syncs deliver every change.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
from test_sync_never_stops import FakeEngine, RecordingClient, make_weights, train, world  # noqa: F401

from vllm_delta import DeltaSender

pytestmark = pytest.mark.heavy


def test_a_gloo_peer_that_joins_and_never_sets_up_is_given_up_on_in_time(world):
    weights, _, _, engine = world
    peer = engine("join-then-stop")
    client = InitRecordingClient(timeout_s=10, retries=0)
    # status_wait_s: the engine's status (asked after each failure) is in before the next plan, so
    # every sync tries it again. A bound, not a sleep: the answer is quick, but under load it took over 5 s.
    sender = DeltaSender([peer.url], "gloo", client=client, collective_timeout_s=3, status_wait_s=30)
    sender.seed(weights)
    reported = train(sender, weights, 2, torch.Generator().manual_seed(4))
    assert len(reported) == 2 and not client.on_main()
    assert [c[1] for c in client.calls].count("collective_init") == 2, "each sync tried, and gave up in time"
    err = sender.engines[peer.url].last_error
    assert err["type"] == "CollectiveInitError" and "not set up within" in err["message"], err
    assert all(m["sender/engines_acked"] == 0 and m["sender/publish_failed"] == 0 for m in reported)
    sender.close()


class InitRecordingClient(RecordingClient):
    def collective_init(self, bodies):
        self._note("collective_init", bodies)
        return super().collective_init(bodies)


# ---- two sender ranks: a failure on one is agreed on by both --------------------------------------
def _two_ranks(rank: int, world_size: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from vllm_delta.sender.shards import Shard
    from vllm_delta.wire import FlushBuilder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    weights = make_weights()
    healthy = FakeEngine(Path(root), weights) if rank == 0 else None
    url = [healthy.url if healthy else None]
    dist.broadcast_object_list(url, src=0)
    mine = {n: t for i, (n, t) in enumerate(weights.items()) if i % world_size == rank}
    sender = DeltaSender(url, "disk", root, group=group, client=RecordingClient(timeout_s=10, retries=0))
    sender.seed([Shard.whole(n, t) for n, t in mine.items()])
    add = FlushBuilder.add

    def failing_add(self, *a, **kw):  # rank 1's encode fails in the second sync
        if self.version == 2 and rank == 1:
            raise OSError("injected: rank 1 could not write its flush")
        return add(self, *a, **kw)

    FlushBuilder.add = failing_add
    gen = torch.Generator().manual_seed(5)
    reported = train(sender, mine, 4, gen)
    failed = [m["sender/publish_failed"] for m in reported]
    assert failed == [0.0, 1.0, 0.0, 0.0], (rank, failed)
    assert reported[-1]["sender/all_acked"] == 1.0, (rank, reported[-1])
    status = sender.status()
    assert status["publish_failures"] == 1, (rank, status)
    assert ("injected" if rank == 1 else "another sender rank") in status["last_error"], (rank, status)
    trained = [None] * world_size
    dist.all_gather_object(trained, mine)
    if rank == 0:  # the engine holds both ranks' tensors, bit for bit, at the last version
        assert healthy.version == sender.version == 4
        for part in trained:
            for n, t in part.items():
                assert torch.equal(healthy.weights[n].view(torch.int16), t.view(torch.int16)), n
    sender.close()
    dist.barrier()
    if healthy:
        healthy.close()


def test_a_rank_that_fails_while_encoding_leaves_no_rank_in_a_collective(tmp_path):
    from harness.megatron_cpu import spawn

    spawn(_two_ranks, 2, str(tmp_path), timeout=120)
