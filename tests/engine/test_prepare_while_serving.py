"""A real `vllm serve` with delta updates: generation goes on while an update is prepared, and a
commit that fails for real part-way keeps the engine drained until an anchor repairs it.

The session's shared Llama engine serves the module (harness/engine_pool): it started with the
test-only fault hook armed for version `FAULT_VERSION` at `FAULT_AT`, a version only this module
reaches; that commit's scatter raises there, after the tensors before it were written. `served`
tracks the weights the engine holds, so the tests run in any order.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import requests
import torch
from harness.engine_pool import FAULT_AT, FAULT_VERSION, write_anchor

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

STREAM_TOKENS = 240
UPDATES = 10


@pytest.fixture(scope="module")
def server(delta_server):
    return delta_server


@pytest.fixture(scope="module")
def served(server, deltas, fresh_loader, tiny_model_factory) -> dict:
    """What the engine holds: its version and weights (checkpoint names), and a fresh load's digests."""
    return {
        "version": server.status()["version"],
        "weights": dict(deltas.base),
        "fresh": fresh_loader.checksums(tiny_model_factory("llama")),
    }


def moved(weights: dict[str, torch.Tensor], seed: int, density: float) -> dict[str, torch.Tensor]:
    """Every tensor with a random `density` of its elements moved by one ULP."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        bits = t.view(-1).view(torch.int16)
        bits[torch.rand(bits.shape, generator=gen) < density] += 1
        out[name] = t
    return out


def post(server, path: Path, version: int, base_version: int | None) -> requests.Response:
    body = {"path": path.name, "version": version}
    if base_version is not None:
        body["base_version"] = base_version
    return server.update(body)


def is_paused(server) -> bool:
    return requests.get(f"{server.url}/is_paused", headers=server.headers(), timeout=30).json()["is_paused"]


def stream(server) -> list[int]:
    """A long greedy completion, streamed; the token ids of its chunks (a chunk may carry several
    tokens when the client reads behind the engine)."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    received: list[int] = []
    with requests.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers(), stream=True, timeout=300
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    received.extend(choice.get("token_ids") or [])
    return received


def streams(server, counts: list[int], stop: threading.Event) -> None:
    """Long completions back to back until `stop`, so generation is going on whenever an update is
    sent (on an idle machine one stream of this tiny model ends within a second); `counts` gets the
    token count of each finished stream."""
    while not stop.is_set():
        counts.append(len(stream(server)))


def test_generation_continues_while_an_update_is_prepared(server, deltas, served):
    """vLLM's own generation_tokens counter moves while a prepare runs. One prepare of this tiny model
    takes tens of milliseconds, which a loaded machine may fill without emitting a token; so up to
    `UPDATES` updates are sent while streams run back to back, and at least one must see tokens
    generated (a prepare that blocked the engine loop would see none in all of them)."""
    chain, weights = [], served["weights"]
    for seed in range(1, UPDATES + 1):  # written up front: the updates follow each other closely
        new = moved(weights, seed=seed, density=0.5)
        version = served["version"] + seed
        chain.append(
            (deltas.write(f"serving{seed}", new, version=version, base_version=version - 1, old=weights), new)
        )
        weights = new
    counts: list[int] = []
    stop = threading.Event()
    streamer = threading.Thread(target=streams, args=(server, counts, stop), daemon=True)
    streamer.start()
    seen = []
    try:
        for path, new in chain:
            resp = post(server, path, served["version"] + 1, served["version"])
            assert resp.status_code == 200, resp.text
            served.update(version=served["version"] + 1, weights=new)
            result = resp.json()
            assert all(isinstance(result[key], float) for key in ("pause_s", "prepare_s")), (
                result
            )  # not judged
            seen.append(result["tokens_during_prepare"])
            print(
                f"prepare_s={result['prepare_s']:.3f} pause_s={result['pause_s']:.3f} "
                f"tokens_during_prepare={result['tokens_during_prepare']} changed={result['changed']}"
            )
            if seen[-1] > 0:
                break
    finally:
        stop.set()
        streamer.join(300)
    assert max(seen) > 0, seen  # vLLM's generation_tokens counter moved during a prepare
    assert counts and all(c == STREAM_TOKENS for c in counts), counts  # every stream finished, none cut short
    assert server.status()["healthy"]


def stripped(checksums: dict[str, str]) -> dict[str, str]:
    return {name.rsplit(":", 1)[-1]: digest for name, digest in checksums.items()}


def test_real_commit_fault_drains_the_engine_until_an_anchor(server, deltas, served):
    before = stripped(server.checksums())
    new = moved(served["weights"], seed=2, density=0.05)
    path = deltas.write(
        "fault", new, version=FAULT_VERSION, base_version=served["version"], old=served["weights"]
    )
    resp = post(server, path, FAULT_VERSION, served["version"])
    assert resp.status_code == 500 and FAULT_AT in resp.json()["error"]["message"], resp.text

    status = server.status()
    fault = status["fault"]
    assert not status["healthy"] and fault["version"] == FAULT_VERSION and fault["failed_at"] == FAULT_AT
    assert FAULT_AT in fault["suspect"] and status["ranks"][0]["dirty"]
    health = requests.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["fault"]["failed_at"] == FAULT_AT
    assert is_paused(server), "a failed commit must not resume generation"
    # The fault is real: tensors before it were written, and only suspect ones.
    after = stripped(server.checksums())
    changed = {n for n in after if after[n] != before[n]}
    assert changed and changed <= set(fault["suspect"]) and FAULT_AT not in changed

    # A plain delta cannot repair it; the engine stays drained.
    refused = post(
        server,
        deltas.write(
            "after-fault",
            moved(new, seed=3, density=0.05),
            version=FAULT_VERSION + 1,
            base_version=FAULT_VERSION,
            old=new,
        ),
        FAULT_VERSION + 1,
        None,
    )
    assert refused.status_code in (400, 409, 500), refused.text
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 503 and is_paused(server)

    # A full anchor back to the checkpoint repairs it: serving resumes, digests equal the fresh load's.
    repaired = post(
        server,
        write_anchor(deltas.fresh_dir("anchor"), deltas.base.items(), FAULT_VERSION + 2),
        FAULT_VERSION + 2,
        None,
    )
    assert repaired.status_code == 200, repaired.text
    served.update(version=FAULT_VERSION + 2, weights=dict(deltas.base))
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200 and not is_paused(server)
    status = server.status()
    assert status["healthy"] and status["fault"] is None and status["version"] == FAULT_VERSION + 2
    assert server.checksums() == served["fresh"]
    assert server.complete()["text"]
