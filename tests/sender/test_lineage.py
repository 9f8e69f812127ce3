"""Lineage (issue 11 item 1) against real-HTTP fake engines that apply the engine workers' own rule.

Fast (no vLLM). Each case is one the version numbers alone got wrong: an engine restarted on the
checkpoint after acking v > S, an engine fed by another sender, lost replies and their replays,
an update with no lineage. The engine refuses with a 409 `LineageError` and changes nothing; the
sender anchors it at the next sync; every engine ends bit-identical to the trainer.
"""

from __future__ import annotations

import json

import pytest
import torch
from sender_helpers import adam_like_step

from vllm_delta import DeltaSender
from vllm_delta.sender.planner import EngineState
from vllm_delta.wire import MANIFEST_NAME, Lineage, LineageError, Manifest, check_lineage, parse_manifest


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def make(tmp_path, engines, **kw) -> DeltaSender:
    kw.setdefault("max_pending_density", 1.0)  # keep catch-ups (no bounded-lag drop) unless a test asks
    return DeltaSender([e.url for e in engines], "disk", tmp_path, flush_bytes=1024, retries=0, **kw)


def clone(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.items()}


# ---- the rule itself -----------------------------------------------------------------------------
RANGED = Lineage(run_id="run-a", min_version=3, max_version=5)


@pytest.mark.parametrize(
    ("engine_version", "engine_run", "version", "ok"),
    [
        (3, "run-a", 6, True),
        (5, "run-a", 6, True),  # inside [S, N-1]
        (6, "run-a", 6, True),  # a replay at the update's own version
        (2, "run-a", 6, False),
        (7, "run-a", 6, False),  # outside the range
        (4, "run-b", 6, False),  # another run's version 4
        (0, None, 6, False),
        (4, None, 6, False),  # restarted on the checkpoint; no run vouches for version 4
    ],
)
def test_ranged_lineage(engine_version, engine_run, version, ok):
    def call():
        return check_lineage(
            RANGED, version=version, engine_version=engine_version, engine_run_id=engine_run, anchor=False
        )

    if ok:
        assert call() == "run-a"
    else:
        with pytest.raises(LineageError) as err:
            call()
        assert err.value.http_status == 409


def test_checkpoint_is_version_zero_of_every_run():
    zero = Lineage(run_id="run-a", min_version=0, max_version=2)
    assert check_lineage(zero, version=3, engine_version=0, engine_run_id=None, anchor=False) == "run-a"
    with pytest.raises(LineageError):
        check_lineage(zero, version=3, engine_version=0, engine_run_id="run-b", anchor=False)


def test_any_version_only_for_a_full_anchor():
    anchor = Lineage(run_id="run-a")
    assert check_lineage(anchor, version=9, engine_version=4, engine_run_id="run-b", anchor=True) == "run-a"
    with pytest.raises(LineageError, match="full anchor"):
        check_lineage(anchor, version=9, engine_version=4, engine_run_id="run-b", anchor=False)


def test_no_lineage_leaves_every_run():
    assert check_lineage(None, version=5, engine_version=4, engine_run_id="run-a", anchor=False) is None


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"run_id": "run-a", "min_version": 4, "max_version": 3}, "min_version"),
        ({"run_id": "run-a", "min_version": 4}, "both"),
        ({"run_id": "bad id/../x", "min_version": 1, "max_version": 1}, "run_id"),
        ({"run_id": "run-a", "min_version": -1, "max_version": 1}, "min_version"),
    ],
)
def test_bad_lineage_in_an_otherwise_valid_manifest(fields, where):
    good = Manifest(version=7, encoding="planes_zstd", lineage=RANGED).model_dump(mode="json")
    assert parse_manifest(json.dumps(good).encode()).lineage == RANGED
    with pytest.raises(Exception) as err:
        parse_manifest(json.dumps({**good, "lineage": fields}).encode())
    assert (
        type(err.value).__name__ == "FormatError" and "lineage" in str(err.value) and where in str(err.value)
    )


def test_manifest_without_lineage_still_reads():
    old = Manifest(version=7, encoding="planes_zstd").model_dump(mode="json")
    del old["lineage"]
    assert parse_manifest(json.dumps(old).encode()).lineage is None


# ---- the sender and the engines ----------------------------------------------------------------------
def test_restarted_engine_refuses_the_catchup_and_is_anchored(tmp_path, fake_engines, fake_weights):
    """Issue 11's case 1: a acked v > S, restarts silently on the checkpoint while b lags, so the
    next update is an overwrite catch-up valid on [S, N-1]. Version numbers alone let a apply it."""
    a, b = fake_engines
    checkpoint = clone(fake_weights)
    sender = make(tmp_path, fake_engines)
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(11)
    adam_like_step(fake_weights, gen)
    assert sender.sync(fake_weights)["sender/all_acked"] == 1.0  # S = 1
    b.fail_versions = {2}
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    assert (a.version, b.version, sender.snapshot_version) == (2, 1, 1)
    assert a.run_id == b.run_id == sender.planner.run_id
    a.restart(checkpoint)  # same URL, version 0, the checkpoint's weights; the sender is not told
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/catchup"] == 1.0 and m["sender/all_acked"] == 0.0
    assert (
        sender.engines[a.url].last_status == 409
        and sender.engines[a.url].last_error["type"] == "LineageError"
    )
    assert a.version == 0 and same(a.weights, checkpoint), "a refused update changes nothing"
    assert b.version == 3 and same(b.weights, fake_weights)
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 1.0 and m["sender/all_acked"] == 1.0
    assert a.requests[-1]["path"].endswith("-anchor")
    assert all(e.version == 4 and same(e.weights, fake_weights) for e in fake_engines)
    assert a.run_id == sender.planner.run_id


def test_engine_of_another_run_refuses_and_is_anchored(tmp_path, fake_engines, fake_weights):
    """Two senders feed one engine at the same version numbers: the second's catch-up is refused."""
    a, b = fake_engines
    other = clone(fake_weights)  # the checkpoint both engines started on
    first = make(tmp_path, [a])
    first.seed(fake_weights)
    gen = torch.Generator().manual_seed(12)
    adam_like_step(fake_weights, gen)
    first.sync(fake_weights)
    second = make(tmp_path, [b])  # b is fresh: version 0 of every run
    second.seed(other)
    adam_like_step(other, gen)
    second.sync(other)
    assert a.version == b.version == 1 and a.run_id != b.run_id
    second.planner.engines[a.url] = EngineState(a.url, acked=1)  # a listed by mistake, as if it acked 1
    adam_like_step(other, gen)
    m = second.sync(other)  # a delta valid on version 1 of second's run, which a is not on
    assert m["sender/all_acked"] == 0.0 and second.engines[a.url].last_error["type"] == "LineageError"
    assert second.engines[a.url].last_status == 409 and a.version == 1 and a.run_id == first.planner.run_id
    m = second.sync(other)
    assert m["sender/anchors"] == 1.0 and m["sender/all_acked"] == 1.0
    assert same(a.weights, other) and same(b.weights, other) and a.run_id == second.planner.run_id


def test_lost_replies_and_replays_converge(tmp_path, fake_engines, fake_weights):
    """The engine applies, the reply is lost (503), the client sends it again: a base-relative delta
    replayed is refused (409), so the sender asks the status, finds its own run at that version,
    and carries on with deltas; an overwrite catch-up replayed is applied again, harmlessly."""
    a, b = fake_engines
    sender = DeltaSender(
        [a.url, b.url], "disk", tmp_path, flush_bytes=1024, retries=1, max_pending_density=1.0
    )
    sender.client.backoff_s = 0.0
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(13)
    a.lose_reply_versions = {1}
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert [r["version"] for r in a.requests] == [1, 1] and sender.engines[a.url].last_status == 409
    assert a.version == 1 and same(a.weights, fake_weights) and m["sender/all_acked"] == 0.0
    b.fail_versions, a.lose_reply_versions = {2}, {2}
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)  # a is asked its status (1, this run): a catch-up
    assert m["sender/catchup"] == 1.0 and sender.engines[a.url].acked == 2 and a.requests[-1]["version"] == 2
    assert [r["version"] for r in a.requests].count(2) == 2, "the overwrite catch-up was sent twice"
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 1.0 and all(
        e.version == 3 and same(e.weights, fake_weights) for e in fake_engines
    )


def test_update_without_lineage_leaves_the_run(tmp_path, fake_engines, fake_weights):
    """Someone pushes a delta with no lineage (an older writer): the engine is then on no run, so the
    sender's next ranged update is refused and it anchors the engine."""
    a, b = fake_engines
    sender = make(tmp_path, fake_engines, keep=True, encoding="deltas_zstd")
    sender.seed(fake_weights)
    gen = torch.Generator().manual_seed(14)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    adam_like_step(fake_weights, gen)
    sender.sync(fake_weights)
    d = tmp_path / "v000002"
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    assert manifest["lineage"] == {"run_id": sender.planner.run_id, "min_version": 1, "max_version": 1}
    del manifest["lineage"]
    (d / MANIFEST_NAME).write_text(json.dumps(manifest))
    import requests

    r = requests.post(f"{a.url}/update_weights_delta", json={"path": d.name, "version": 2}, timeout=30)
    assert r.status_code == 200 and a.version == 2 and a.run_id is None
    adam_like_step(fake_weights, gen)
    m = sender.sync(fake_weights)
    assert m["sender/all_acked"] == 0.0 and sender.engines[a.url].last_error["type"] == "LineageError"
    m = sender.sync(fake_weights)
    assert m["sender/anchors"] == 1.0 and all(same(e.weights, fake_weights) for e in fake_engines)


def test_sender_started_at_a_version_resumes_the_engines_run_only_if_they_agree(
    tmp_path, fake_engines, fake_weights
):
    a, b = fake_engines
    first = make(tmp_path, fake_engines)
    first.seed(fake_weights)
    gen = torch.Generator().manual_seed(15)
    adam_like_step(fake_weights, gen)
    first.sync(fake_weights)
    resumed = make(tmp_path, fake_engines, version=1)  # the caller says: the engines hold these at 1
    resumed.seed(fake_weights)
    adam_like_step(fake_weights, gen)
    m = resumed.sync(fake_weights)
    assert resumed.planner.run_id == first.planner.run_id and m["sender/anchors"] == 0.0
    assert m["sender/all_acked"] == 1.0 and all(same(e.weights, fake_weights) for e in fake_engines)
    b.run_id = "someone-else"  # same version, another run's weights: nobody can vouch for either
    again = make(tmp_path, fake_engines, version=2)
    again.seed(fake_weights)
    adam_like_step(fake_weights, gen)
    m = again.sync(fake_weights)
    assert again.planner.run_id not in (first.planner.run_id, "someone-else")
    assert m["sender/anchors"] == 2.0 and m["sender/all_acked"] == 1.0
    assert all(e.run_id == again.planner.run_id and same(e.weights, fake_weights) for e in fake_engines)
