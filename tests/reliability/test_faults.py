"""Faults with real processes (issue 11 items 1 and 8): two real `vllm serve` engines, a sender, and
the things that go wrong between them, each produced for real.

- an engine that acked v > S restarts silently on the checkpoint (same port) while the other lags,
  so the next update is an overwrite catch-up: it must refuse it (409 `LineageError`), then be
  anchored;
- an engine SIGKILLed while an update is in flight, restarted on the same port;
- a sender process SIGKILLed at random points while it writes;
- the delta root (a small tmpfs this module mounts) filling up while the sender writes;
- one engine unreachable (its TCP proxy closed) for more syncs than `max_lag_syncs`, then back.

After each: no engine reports healthy on wrong weights, and the fleet converges to the trainer's
weights: both engines' vLLM `/weight_checker` digests equal those of the trainer's weights loaded
afresh by vLLM's own loader (harness/fresh_load: code other than our apply path), and each engine's
full verify against the trainer's whole-tensor digests passes.

The engines are the session's engine pair (harness/engine_pair.py, shared with other modules); every
test starts by anchoring both on the trainer's current weights (`fleet.fresh_sender`), so each passes
alone and in any order, and a restart goes through the pair, so the modules after this one find it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from harness.engine_pair import EnginePair
from harness.engine_pool import API_KEY
from harness.engine_pool import HEADERS as HDR
from harness.fresh_load import save_checkpoint
from harness.perturb import perturb_tensor
from harness.vllm_engine import VllmServer

from vllm_delta import DeltaSender
from vllm_delta.wire.checkpoint import Checkpoint

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


class Gate:
    """A TCP proxy in front of an engine: `down()` closes it (connections refused, live ones cut),
    `up()` listens again on the same port. Unreachability at the socket level, not a fake reply."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.up()
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self.writers.difference_update((writer, up_writer))

    def up(self) -> None:
        async def start():
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            self.port = self.server.sockets[0].getsockname()[1]

        self._call(start())

    def down(self) -> None:
        async def stop():
            self.server.close()
            for w in list(self.writers):
                w.close()
            await self.server.wait_closed()

        self._call(stop())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def status(url: str) -> dict:
    r = requests.get(f"{url}/delta_updates/status", headers=HDR, timeout=60)
    r.raise_for_status()
    return r.json()


def checksums(url: str) -> dict[str, str]:
    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, headers=HDR, timeout=120)
    r.raise_for_status()
    return r.json()["checksums"]


def verify(url: str) -> dict:
    r = requests.post(f"{url}/delta_updates/verify", headers=HDR, timeout=300)
    r.raise_for_status()
    return r.json()


class Fleet:
    """The pair's two engines (b behind a `Gate`), the trainer's weights, and a sender factory."""

    def __init__(self, pair: EnginePair, logs: Path, fresh_loader) -> None:
        self.pair, self.model_dir, self.root = pair, pair.model_dir, pair.root
        self.logs, self.fresh_loader = logs, fresh_loader
        pair.live()
        self.gate = Gate(self.b.port)
        self.checkpoint = dict(Checkpoint.open(self.model_dir).iter_tensors())
        self.weights = {n: t.clone() for n, t in self.checkpoint.items()}  # the trainer's
        self.gen = torch.Generator().manual_seed(0)
        self.base_digests = fresh_loader.checksums(self.model_dir)  # the checkpoint's, loaded by vLLM alone
        self.saved = 0

    @property
    def a(self) -> VllmServer:
        return self.pair.engines[0]

    @property
    def b(self) -> VllmServer:
        return self.pair.engines[1]

    def step(self, density: float = 0.02) -> None:
        for n, t in self.weights.items():
            self.weights[n] = perturb_tensor(t, density, self.gen)

    def fresh_sender(self, **kw) -> DeltaSender:
        """A sender that anchors both engines on the trainer's current weights, whatever they held."""
        version = max(status(u)["version"] for u in (self.a.url, self.gate.url))
        kw = {"flush_bytes": 64 << 10, "retries": 0, "timeout_s": 120, "max_pending_density": 1.0, **kw}
        s = DeltaSender(
            [self.a.url, self.gate.url], "disk", self.root, api_key=API_KEY, version=version, **kw
        )
        s.seed(self.weights)
        s.request_anchor()
        m = s.sync(self.weights)
        assert m["sender/all_acked"] == 1.0 and m["sender/anchors"] == 2.0, s.engines
        return s

    def restart_a(self, kill: bool = False) -> None:
        """Stop engine a (SIGKILL to its process group, or a clean stop) and start it on the same port."""
        port = self.a.port
        self.pair.restart(0, kill=kill)
        assert self.a.url.endswith(f":{port}")

    def assert_converged(self) -> None:
        """Both engines healthy, on the sender's weights by two routes, and verified against its digests."""
        sa, sb = status(self.a.url), status(self.gate.url)
        assert sa["healthy"] and sb["healthy"] and sa["version"] == sb["version"], (sa, sb)
        assert sa["run_id"] == sb["run_id"] is not None
        self.saved += 1
        trained = save_checkpoint(self.weights, self.model_dir, self.logs / f"trained{self.saved}")
        want = self.fresh_loader.checksums(trained)
        assert checksums(self.a.url) == want and checksums(self.b.url) == want
        for url in (self.a.url, self.gate.url):
            v = verify(url)
            assert v["ok"] and v["digests_checked"] == len(self.checkpoint), v

    def close(self) -> None:
        self.gate.close()


@pytest.fixture(scope="module")
def root(engine_pair) -> Path:
    """The pair's delta root: a 16 MiB tmpfs (so a test can fill it), or a plain directory if mounting
    failed."""
    return engine_pair.root


@pytest.fixture(scope="module")
def fleet(engine_pair, tmp_path_factory, fresh_loader):
    f = Fleet(engine_pair, tmp_path_factory.mktemp("faults_logs"), fresh_loader)
    try:
        yield f
    finally:
        f.close()


def test_engine_restarted_silently_refuses_the_catchup_and_is_anchored(fleet):
    """Issue 11 case 1 with real engines: version numbers alone would let a apply a catch-up that
    assumes it holds [S, N-1]; with the post-hash it would go dirty, without it, silently wrong."""
    s = fleet.fresh_sender()
    fleet.step()
    assert s.sync(fleet.weights)["sender/all_acked"] == 1.0
    fleet.gate.down()  # b misses the next version
    fleet.step()
    m = s.sync(fleet.weights)
    fleet.gate.up()
    assert m["sender/all_acked"] == 0.0 and s.engines[fleet.gate.url].last_status == 0
    assert status(fleet.a.url)["version"] == s.version > s.snapshot_version
    fleet.restart_a()  # same port, the base checkpoint, version 0; the sender is not told
    assert status(fleet.a.url)["run_id"] is None
    fleet.step()
    m = s.sync(fleet.weights)
    assert m["sender/catchup"] == 1.0, m
    a = s.engines[fleet.a.url]
    assert a.last_status == 409 and a.last_error["type"] == "LineageError", a
    st = status(fleet.a.url)
    assert st["version"] == 0 and st["healthy"] and checksums(fleet.a.url) == fleet.base_digests
    assert status(fleet.gate.url)["version"] == s.version
    fleet.step()
    m = s.sync(fleet.weights)
    assert m["sender/anchors"] == 1.0 and m["sender/all_acked"] == 1.0, s.engines
    fleet.assert_converged()


def test_engine_killed_with_an_update_in_flight_is_anchored(fleet):
    s = fleet.fresh_sender()
    fleet.step(density=0.2)
    version = s.version + 1
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(s.sync(fleet.weights)))
    worker.start()
    deadline = time.monotonic() + 120
    manifest = fleet.root / f"v{version:06d}" / "manifest.json"
    while not manifest.exists() and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)  # sealed: the push follows at once
    time.sleep(random.Random(version).uniform(0.0, 0.05))
    fleet.restart_a(kill=True)  # SIGKILL now; back on the same port, at version 0, on the checkpoint
    worker.join(180)
    answered = out["sender/all_acked"] == 1.0  # a may have answered just before it died
    assert status(fleet.a.url)["version"] == 0 and checksums(fleet.a.url) == fleet.base_digests
    anchors = 0.0
    for _ in range(2):  # if a answered, the sender learns of the restart from a 409 first
        fleet.step()
        m = s.sync(fleet.weights)
        anchors += m["sender/anchors"]
        if m["sender/all_acked"] == 1.0:
            break
        assert answered and s.engines[fleet.a.url].last_error["type"] == "LineageError", s.engines
    assert anchors == 1.0 and m["sender/all_acked"] == 1.0, s.engines
    fleet.assert_converged()


KILLED_SENDER = """
import sys, torch
from vllm_delta import DeltaSender
from vllm_delta.wire.checkpoint import Checkpoint
url, root, model, version, key = sys.argv[1:6]
s = DeltaSender([url], "disk", root, api_key=key, flush_bytes=16 << 10, throttle_bytes_per_s=128 << 10,
                version=int(version), retries=0)
s.seed_from_checkpoint(model)
s.request_anchor()
s.sync(Checkpoint.open(model).iter_tensors())
"""


def test_sender_killed_at_random_points_never_leaves_an_engine_on_partial_weights(fleet):
    s = fleet.fresh_sender()
    rng = random.Random(8)
    for _ in range(3):
        before, st = checksums(fleet.a.url), status(fleet.a.url)
        version = st["version"] + 1000
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                KILLED_SENDER,
                fleet.a.url,
                str(fleet.root),
                str(fleet.model_dir),
                str(version),
                API_KEY,
            ]
        )
        d = fleet.root / f"v{version + 1:06d}-anchor"
        deadline = time.monotonic() + 120
        while not d.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 4.0))  # the whole anchor takes about 6 s at this throttle
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)  # a push that reached the engine finishes (or not) on its own
        st2 = status(fleet.a.url)
        assert st2["healthy"]
        if st2["version"] == version + 1:  # killed after its push: the anchor it sent was whole
            assert checksums(fleet.a.url) == fleet.base_digests
        else:
            assert st2["version"] == st["version"] and checksums(fleet.a.url) == before
            if d.exists() and not (d / "manifest.json").exists():  # killed mid-write: nothing applicable
                r = requests.post(
                    f"{fleet.a.url}/update_weights_delta",
                    json={"path": d.name, "version": version + 1},
                    headers=HDR,
                    timeout=60,
                )
                assert r.status_code == 400 and r.json()["error"]["type"] == "IncompleteDeltaError", r.text
                assert checksums(fleet.a.url) == before and status(fleet.a.url)["version"] == st["version"]
        shutil.rmtree(d, ignore_errors=True)
    fleet.step()
    m = s.sync(fleet.weights)  # a is on the killed sender's run or behind: anchored if need be
    if m["sender/all_acked"] == 0.0:
        m = s.sync(fleet.weights)
    assert m["sender/all_acked"] == 1.0, s.engines
    fleet.assert_converged()


def test_disk_full_mid_write_applies_nothing_and_recovers(fleet, root):
    if not os.path.ismount(root):
        pytest.skip("could not mount a tmpfs for the delta root here")
    s = fleet.fresh_sender()
    before = {u: (status(u)["version"], checksums(u)) for u in (fleet.a.url, fleet.gate.url)}
    free = shutil.disk_usage(root).free
    ballast = root / "ballast"
    with open(ballast, "wb") as f:  # leave ~32 KiB: less than the anchor below
        f.write(b"\0" * max(0, free - (32 << 10)))
    try:
        fleet.step()
        s.request_anchor()
        with pytest.raises(Exception) as err:
            s.sync(fleet.weights)
        cause = err.value
        while cause.__cause__ is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(err.value)
        for u, (v, digests) in before.items():
            st = status(u)
            assert st["version"] == v and st["healthy"] and checksums(u) == digests
        partial = [p for p in root.glob("v*") if not (p / "manifest.json").exists()]
        for p in partial:  # whatever the writer left is not a delta an engine would take
            r = requests.post(
                f"{fleet.a.url}/update_weights_delta",
                json={"path": p.name, "version": s.version},
                headers=HDR,
                timeout=60,
            )
            assert r.status_code == 400 and r.json()["error"]["type"] == "IncompleteDeltaError", r.text
    finally:
        ballast.unlink()
    fleet.step()
    m = s.sync(fleet.weights)
    assert m["sender/all_acked"] == 1.0, s.engines
    fleet.assert_converged()


def test_engine_unreachable_for_k_syncs_is_dropped_then_anchored(fleet):
    s = fleet.fresh_sender(max_lag_syncs=2)
    fleet.gate.down()
    try:
        seen = []
        for _ in range(3):
            fleet.step()
            m = s.sync(fleet.weights)
            seen.append((m["sender/catchup"], m["sender/anchors"], m["sender/all_acked"]))
            assert status(fleet.a.url)["version"] == s.version
    finally:
        fleet.gate.up()
    # 1: b misses; 2: catch-up for a, b misses again (dropped: the snapshot moves on); 3: a is back on
    # base-relative deltas while b is still away.
    assert seen == [(0.0, 0.0, 0.0), (1.0, 0.0, 1.0), (0.0, 0.0, 1.0)], seen
    assert s.snapshot_version == s.version
    fleet.step()
    m = s.sync(fleet.weights)
    assert m["sender/anchors"] == 1.0 and m["sender/catchup"] == 0.0 and m["sender/all_acked"] == 1.0
    fleet.assert_converged()
