"""The native door at TP=2: a refused update leaves every later RPC answering its own call.

Why its own engine: vLLM 0.32's multiprocess `collective_rpc` raises at the first rank's failure
and leaves the other ranks' replies queued, so a worker method that raises on both ranks makes the
next RPC read the stale failure (every later call off by one). Only a TP >= 2 engine has more than
one reply queue; the other native tests run at TP=1. Bit-exactness at TP=2 against a fresh TP=2
load was checked once by hand (docs/results/prepare_while_serving.md); here the served digests
must be unchanged by the refusal and the engine healthy at the good update's version after it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import requests
import torch
from harness.vllm_engine import VllmServer
from native_helpers import NATIVE, Streams, checksums, native_update, write_delta
from safetensors.torch import load_file

from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return Path(os.path.realpath(tmp_path_factory.mktemp("native_tp2_root")))


@pytest.fixture(scope="module")
def served(tiny_model_factory, root, tmp_path_factory):
    log = tmp_path_factory.mktemp("native_tp2") / "serve.log"
    with VllmServer(
        tiny_model_factory("llama"),
        log,
        tp=2,
        extra_args=NATIVE,
        env={ROOT_ENV: str(root), "VLLM_PLUGINS": "delta_updates"},
    ) as s:
        yield s


def test_refusal_at_tp2_then_rpcs_and_the_next_update_work(served, tiny_model_factory, root):
    """A corrupt delta is refused (400 naming its file) on both ranks; then vLLM's own RPCs answer
    (`/weight_checker`, digests unchanged) and a good 50% delta applies while a stream generates."""
    assert requests.get(f"{served.url}/delta_updates/status", timeout=60).json()["version"] == 0
    base = load_file(tiny_model_factory("llama") / "model.safetensors")
    new, gen = {n: t.clone() for n, t in base.items()}, torch.Generator().manual_seed(7)
    for t in new.values():
        bits = t.view(-1).view(torch.int16)
        bits[torch.rand(bits.shape, generator=gen) < 0.5] += 1
    good = write_delta(root, "good", new, base, 1, 0)
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    flush = next(corrupt.glob("*.safetensors"))
    data = bytearray(flush.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flush.write_bytes(bytes(data))
    before = checksums(served.url)
    with Streams(served.url, 240) as streams:
        r, _ = native_update(served.url, {"path": corrupt.name, "version": 1, "base_version": 0}, "1")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "IntegrityError" and r.json()["error"]["file"] == flush.name, (
            r.text
        )
        assert checksums(served.url) == before  # vLLM's own RPC answers, and nothing was written
        r, done = native_update(served.url, {"path": good.name, "version": 1, "base_version": 0}, "1")
        assert r.status_code == 200 and done is not None and done["changed"] > 0, r.text
        print("tp2 " + json.dumps({k: done[k] for k in ("prepare_s", "pause_s", "tokens_during_prepare")}))
    assert streams.counts and all(c == 240 for c in streams.counts), streams.counts
    st = requests.get(f"{served.url}/delta_updates/status", timeout=60).json()
    assert st["version"] == 1 and st["weight_version"] == "1" and st["healthy"], st
    assert checksums(served.url) != before
