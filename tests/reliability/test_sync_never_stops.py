"""A sync never stops training (issue 18 item 6), with real processes.

The trainer here is the Megatron hook's path: every step changes the weights, then `capture()` and
`publish()` (the push runs in the background, overlapping the next step), and the previous
publish's metrics are read from its future, as `HookHandle.fire` does. Each fault is real:

- an engine process SIGKILLed mid-run (connections refused);
- an engine process SIGSTOPped (connections accepted, never answered), then SIGCONT;
- the delta root unwritable for one sync (a publish that raises);
- and, in test_sync_groups.py, a gloo peer that never sets up its channel and a two-rank sender.

Through each: every step runs, nothing is raised into the loop, no engine status is asked on the
training thread (the client records the thread of every request), the healthy engine gets every
version, and the failure shows in the metrics and in `status()`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_delta import DeltaSender
from vllm_delta.client import EngineClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sender"))
from sender_helpers import FakeEngine, adam_like_step  # noqa: E402

pytestmark = pytest.mark.heavy
ENGINE = Path(__file__).with_name("engine_process.py")
STEPS = 6


def make_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16) for i in range(3)
    }


class RecordingClient(EngineClient):
    """The real HTTP client; it notes which thread asked each engine what."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def _note(self, route: str, urls) -> None:
        with self._lock:
            self.calls.append((threading.current_thread().name, route, tuple(urls)))

    def status(self, urls):
        self._note("status", urls)
        return super().status(urls)

    def update(self, bodies):
        self._note("update", bodies)
        return super().update(bodies)

    def on_main(self) -> list:
        return [c for c in self.calls if c[0] == threading.main_thread().name]


class EngineProcess:
    """engine_process.py in a process group of its own, on `weights`."""

    def __init__(self, tmp: Path, weights: dict[str, torch.Tensor], root: Path, mode: str = "serve") -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(tmp / "weights.safetensors"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE), str(tmp / "weights.safetensors"), str(root), mode],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait(30)


def train(
    sender: DeltaSender,
    weights: dict[str, torch.Tensor],
    steps: int,
    gen: torch.Generator,
    between=lambda i: None,
) -> list[dict[str, float]]:
    """`steps` training steps with the hook's capture/publish after each; the metrics of each
    publish, read from its future once it is done (as the hook reports them)."""
    reported, future = [], None
    for i in range(steps):
        adam_like_step(weights, gen)
        sender.capture(weights)  # waits for the previous publish, if still running
        if future is not None:
            reported.append(future.result())
        future = sender.publish()
        between(i)
    sender.wait()
    reported.append(future.result())
    return reported


@pytest.fixture
def world(tmp_path):
    weights = make_weights()
    root = tmp_path / "deltas"
    root.mkdir()
    healthy = FakeEngine(root, weights)
    procs: list[EngineProcess] = []

    def engine(mode: str = "serve") -> EngineProcess:
        procs.append(EngineProcess(tmp_path / f"engine{len(procs)}", weights, root, mode))
        return procs[-1]

    yield weights, root, healthy, engine
    healthy.close()
    for p in procs:
        p.close()


def _sender(urls, root, client, **kw) -> DeltaSender:
    return DeltaSender(urls, "disk", root, client=client, max_lag_syncs=2, **kw)


def test_a_killed_engine_costs_the_training_loop_nothing(world):
    weights, root, healthy, engine = world
    dead = engine()
    client = RecordingClient(timeout_s=5, retries=1, backoff_s=0.2)
    sender = _sender([healthy.url, dead.url], root, client)
    sender.seed(weights)
    assert sender.sync(weights)["sender/all_acked"] == 1.0
    dead.signal(signal.SIGKILL)
    dead.proc.wait(30)
    client.calls.clear()
    reported = train(sender, weights, STEPS, torch.Generator().manual_seed(1))
    assert len(reported) == STEPS and healthy.version == sender.version == 1 + STEPS
    assert not client.on_main(), "engine status or updates were asked on the training thread"
    probes = [c for c in client.calls if c[1] == "status" and dead.url in c[2]]
    assert 1 <= len(probes) <= STEPS, "one probe in flight at a time, in the background"
    assert {c[0] for c in probes} == {"vllm-delta-probe"}
    st = sender.status()["engines"][dead.url]
    assert st["acked"] is None and st["needs_anchor"], st  # dropped after max_lag_syncs; owed an anchor
    assert all(m["sender/publish_failed"] == 0.0 for m in reported)
    assert all(m["sender/engines_acked"] >= 1 for m in reported)
    sender.close()


def test_a_stopped_engine_is_skipped_while_hung_and_anchored_once_it_answers(world):
    weights, root, healthy, engine = world
    hung = engine()
    client = RecordingClient(timeout_s=2, retries=0)
    sender = _sender([healthy.url, hung.url], root, client)
    sender.seed(weights)
    sender.sync(weights)
    hung.signal(signal.SIGSTOP)
    client.calls.clear()
    reported = train(sender, weights, STEPS, torch.Generator().manual_seed(2))
    assert len(reported) == STEPS and healthy.version == sender.version
    assert not client.on_main()
    assert sender.status()["engines"][hung.url]["acked"] is None
    assert sum(m["sender/engines_acked"] == 2 for m in reported) == 0
    pushes = [c for c in client.calls if c[1] == "update" and hung.url in c[2]]
    assert len(pushes) == 1, "one update timed out; while its status is being asked, it gets none"
    probes = [c for c in client.calls if c[1] == "status" and hung.url in c[2]]
    assert 1 <= len(probes) <= 2, f"one probe in flight at a time, not one per sync: {len(probes)}"
    hung.signal(signal.SIGCONT)
    deadline = time.monotonic() + 60  # its probe answers in the background (slowly on a loaded host)
    while time.monotonic() < deadline:  # then it is anchored
        reported = train(sender, weights, 1, torch.Generator().manual_seed(3))
        if sender.engines[hung.url].acked == sender.version:
            break
        time.sleep(0.5)
    assert sender.engines[hung.url].acked == sender.version == healthy.version, sender.status()
    assert not client.on_main()
    sender.close()


def test_a_publish_that_fails_is_recorded_and_the_loop_goes_on(world):
    """A real write failure: the delta root is replaced by a file for one sync, then restored. The
    engine's status is asked after the failure (in the background: `status_wait_s` bounds how long the
    next capture waits for the answer, so the catch-up does not depend on the box's load); then it
    catches up."""
    weights, root, healthy, _ = world
    client = RecordingClient(timeout_s=5, retries=0)
    sender = _sender([healthy.url], root, client, status_wait_s=30.0)
    sender.seed(weights)
    sender.sync(weights)
    root.rename(root.with_name("kept"))
    root.write_bytes(b"not a directory")

    def restore(i: int) -> None:
        if i == 0:
            sender.wait()  # the first publish has failed; the next ones write into the root again
            root.unlink()
            root.with_name("kept").rename(root)

    reported = train(sender, weights, 4, torch.Generator().manual_seed(6), between=restore)
    assert [m["sender/publish_failed"] for m in reported] == [1.0, 0.0, 0.0, 0.0]
    st = sender.status()
    assert st["publish_failures"] == 1 and "Error" in st["last_error"], st
    assert reported[-1]["sender/all_acked"] == 1.0 and healthy.version == sender.version == 5
    for n, t in weights.items():  # the pending changes of the failed syncs arrived with the later ones
        assert torch.equal(healthy.weights[n].view(torch.int16), t.view(torch.int16)), n
    assert not client.on_main()
    sender.close()
