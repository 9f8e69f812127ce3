"""The collective protocol on real gloo groups, without an engine: the spool's bounded window, the
offer/answer/go handshake, one-flush-at-a-time streaming, a refusal that moves no bulk byte, and a
peer killed mid-stream that leaves the trainer with an exception (not a hang, not a dead process).

The engine side runs in a spawned process (a real peer that can be killed); the trainer side here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile

import pytest

from vllm_delta.transports.collective import FlushSpool, Refused, answer, manifest_digest, offer, stream
from vllm_delta.transports.groups import host_group, join_group, listen
from vllm_delta.wire.errors import IncompleteDeltaError, LimitError

FLUSHES = [
    ("rank0000_flush000000.safetensors", b"a" * 3000),
    ("rank0000_flush000001.safetensors", b"b" * 5000),
    ("rank0000_flush000002.safetensors", b"c" * 700),
]
MANIFEST = {"version": 7, "files": [{"name": n, "bytes": len(d), "hash": "x"} for n, d in FLUSHES]}


def test_spool_keeps_a_bounded_window_in_memory_and_reads_back_every_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spool = FlushSpool(window_bytes=4000)
    for name, data in FLUSHES:
        spool.add(name, data)
    assert spool.held_bytes == 3700 <= 4000 and spool.spilled_bytes == 5000  # the 5000 B one did not fit
    assert list(spool) == FLUSHES and [n for n, _ in spool] == [n for n, _ in FLUSHES]
    assert [len(spool.read(n)) for n, _ in FLUSHES] == [len(d) for _, d in FLUSHES]
    assert not list(tmp_path.iterdir()), "the spill file is unlinked at once"
    with pytest.raises(ValueError, match="already spooled"):
        spool.add(FLUSHES[0][0], b"x")
    spool.close()


def _engine(port: int, caps: list[int], results, die_after: int | None, manifest: dict) -> None:
    """An engine rank: answer one offer per per-flush cap in `caps`, receive what each go lets through."""
    group = join_group(
        master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, backend="gloo", timeout_s=30
    )
    for cap in caps:
        try:
            receiver, checked = answer(group, manifest, 7, cap, lambda: "checked")
        except Exception as exc:
            results.put(("refused", type(exc).__name__, getattr(exc, "file", None)))
            continue
        got = []
        for name, data in receiver:
            got.append((name, data))
            if die_after is not None and len(got) == die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash mid-stream
        results.put(("received", checked, got))


def _run(caps: list[int], die_after: int | None = None, manifest: dict = MANIFEST):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sock = listen("127.0.0.1")
    proc = ctx.Process(
        target=_engine, args=(sock.getsockname()[1], caps, results, die_after, manifest), daemon=True
    )
    proc.start()
    group = host_group(sock, world_size=2, backend="gloo", timeout_s=30)
    return group, proc, results


SIZES = [(n, len(d)) for n, d in FLUSHES]


class _ControlPlane:
    """An engine rank's view of its group's store, in memory: rank 0's offer and go, this rank's answer."""

    def __init__(self, offer: dict, go: dict | None = None) -> None:
        self.seq, self.rank = 0, 1
        self.kv = {"1/offer": offer, "1/go": go or {"go": True, "refusal": None}}

    def get(self, key: str):
        return self.kv[key]

    def put(self, key: str, value) -> None:
        self.kv[key] = value


OFFER = {"version": 7, "manifest_sha256": manifest_digest(MANIFEST), "flushes": [list(f) for f in SIZES]}


def test_the_manifest_digest_is_the_same_whatever_the_key_order():
    assert manifest_digest(dict(reversed(MANIFEST.items()))) == manifest_digest(MANIFEST)
    assert manifest_digest({**MANIFEST, "version": 8}) != manifest_digest(MANIFEST)


@pytest.mark.parametrize(
    "change",
    [
        {"manifest_sha256": manifest_digest({**MANIFEST, "version": 8})},  # the offer is for another manifest
        {"version": 8},  # for another version of this one
        {"flushes": [list(f) for f in SIZES[:2]]},  # a flush fewer than the manifest lists
        {"flushes": [[n, size + 1] for n, size in SIZES]},  # other sizes
    ],
    ids=["manifest", "version", "fewer-flushes", "sizes"],
)
def test_an_offer_that_does_not_match_this_request_is_answered_with_a_refusal(change):
    plane = _ControlPlane({**OFFER, **change})
    with pytest.raises(IncompleteDeltaError):
        answer(plane, MANIFEST, 7, 1 << 20, lambda: "checked")
    assert (plane.kv["1/answer/1"]["ok"], plane.kv["1/answer/1"]["type"]) == (False, "IncompleteDeltaError")


def test_a_flush_over_the_cap_is_refused_naming_it_and_a_matching_offer_is_accepted():
    plane = _ControlPlane(dict(OFFER))
    with pytest.raises(LimitError):
        answer(plane, MANIFEST, 7, 4000, lambda: "checked")
    assert (plane.kv["1/answer/1"]["file"], plane.kv["1/answer/1"]["status"]) == (FLUSHES[1][0], 400)
    plane = _ControlPlane(dict(OFFER))
    receiver, checked = answer(plane, MANIFEST, 7, 5000, lambda: "checked")
    assert checked == "checked" and receiver.flushes == SIZES and plane.kv["1/answer/1"] == {"ok": True}


def test_another_ranks_refusal_is_raised_with_its_status():
    refusal = {
        "ok": False,
        "status": 409,
        "type": "LineageError",
        "message": "other run",
        "file": None,
        "param": None,
    }
    with pytest.raises(Refused, match="LineageError on another rank") as got:
        answer(
            _ControlPlane(dict(OFFER), {"go": False, "refusal": refusal}), MANIFEST, 7, 1 << 20, lambda: None
        )
    assert got.value.http_status == 409


@pytest.mark.heavy  # spawns the engine-side peer
def test_refused_offer_moves_no_bulk_byte_and_the_next_offer_streams_one_flush_at_a_time():
    group, proc, results = _run([4000, 1 << 20])  # the 5000 B flush is over the first per-flush cap
    assert offer(group, 7, MANIFEST, SIZES, stop=lambda: False) is False
    assert group.bytes_sent == 0
    assert (group.refusal["type"], group.refusal["file"], group.refusal["status"]) == (
        "LimitError",
        FLUSHES[1][0],
        400,
    )
    assert results.get(timeout=30) == ("refused", "LimitError", FLUSHES[1][0])
    assert offer(group, 7, MANIFEST, SIZES, stop=lambda: False) is True
    stream(group, (d for _, d in FLUSHES))
    assert group.bytes_sent == sum(len(d) for _, d in FLUSHES)
    assert results.get(timeout=30) == ("received", "checked", FLUSHES)
    proc.join(30)
    assert proc.exitcode == 0
    group.close()


@pytest.mark.heavy  # spawns the engine-side peer
def test_offer_for_another_manifest_is_refused_by_the_engine():
    group, proc, results = _run([1 << 20])
    assert offer(group, 7, {**MANIFEST, "version": 8}, SIZES, stop=lambda: False) is False
    assert group.bytes_sent == 0 and group.refusal["type"] == "IncompleteDeltaError"
    assert results.get(timeout=30) == ("refused", "IncompleteDeltaError", None)
    proc.join(30)
    group.close()


@pytest.mark.heavy  # spawns the engine-side peer
def test_engine_killed_mid_stream_raises_in_the_trainer_instead_of_hanging():
    # Flushes larger than the socket buffers, so a send can only finish if the peer reads it.
    big = [(f"rank0000_flush{i:06d}.safetensors", bytes([i]) * (32 << 20)) for i in range(3)]
    manifest = {"version": 7, "files": [{"name": n, "bytes": len(d), "hash": "x"} for n, d in big]}
    group, proc, results = _run([1 << 30], die_after=1, manifest=manifest)
    assert offer(group, 7, manifest, [(n, len(d)) for n, d in big], stop=lambda: False) is True
    with pytest.raises(RuntimeError):
        stream(group, (d for _, d in big))
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    group.close()
