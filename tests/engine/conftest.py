"""Fixtures for the engine tests: a `vllm serve` with delta updates on, and deltas for its model.

Why a shared server: a CPU engine takes tens of seconds to start, so every bad-input case of a
module runs against the same server and checks afterwards that it was left unharmed, and modules
that need the same engine take it from the session's pool (harness/engine_pool.py), reset to its
checkpoint when they start.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
from harness.engine_pool import API_KEY, reset_to_checkpoint
from harness.vllm_engine import VllmServer
from safetensors.torch import load_file

from vllm_delta.diff import diff_param
from vllm_delta.wire import DeltaWriter, tensor_digest

PROMPT = "The quick brown fox"


class DeltaServer:
    """A running server plus the requests the tests make to it, authorized with `API_KEY`."""

    def __init__(self, server: VllmServer, root: Path) -> None:
        self.server, self.root, self.url = server, root, server.url

    def headers(self, key: str | None = API_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key is not None else {}

    def update(
        self,
        body: object = None,
        *,
        raw: bytes | None = None,
        key: str | None = API_KEY,
        headers: dict[str, str] | None = None,
    ) -> requests.Response:
        data = raw if raw is not None else json.dumps(body).encode()
        return requests.post(
            f"{self.url}/update_weights_delta",
            data=data,
            timeout=120,
            headers={"Content-Type": "application/json", **self.headers(key), **(headers or {})},
        )

    def status(self) -> dict:
        resp = requests.get(f"{self.url}/delta_updates/status", headers=self.headers(), timeout=60)
        resp.raise_for_status()
        return resp.json()

    def checksums(self) -> dict[str, str]:
        resp = requests.post(
            f"{self.url}/weight_checker", json={"action": "checksum"}, headers=self.headers(), timeout=120
        )
        resp.raise_for_status()
        return resp.json()["checksums"]

    def complete(self, prompt: str = PROMPT) -> dict:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        resp = requests.post(f"{self.url}/v1/completions", json=body, headers=self.headers(), timeout=120)
        resp.raise_for_status()
        return resp.json()["choices"][0]

    def greedy(self, prompt: str = PROMPT) -> tuple[list[int], list[float]]:
        """Greedy token ids and their logprobs. A fresh cache salt per call: every call computes the
        prompt afresh, so two calls on the same weights take the same path and agree bit for bit."""
        body = {
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex,
        }
        resp = requests.post(f"{self.url}/v1/completions", json=body, headers=self.headers(), timeout=120)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def baseline(self) -> Baseline:
        """What `assert_unharmed` compares against: take it before the case."""
        return Baseline(self.checksums(), self.greedy())

    def assert_unharmed(self, before: Baseline, version: int) -> None:
        """Weights digest-identical to `before`, status healthy at `version`, and the same greedy tokens
        with the same logprobs as `before`."""
        assert self.checksums() == before.checksums, "a refused update changed the weights"
        status = self.status()
        assert status["healthy"] and status["version"] == version, status
        assert self.greedy() == before.greedy, "a refused update changed the served output"


@dataclass(frozen=True)
class Baseline:
    """The served weights' digests and greedy output, taken before a case."""

    checksums: dict[str, str]
    greedy: tuple[list[int], list[float]]


def child_environ(server: VllmServer) -> list[dict[str, str]]:
    """The environment of every process the server started (engine core, workers)."""
    envs = []
    for pid in _descendants(server.proc.pid):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        envs.append(dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv))
    return envs


def _descendants(pid: int) -> list[int]:
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += [int(child), *_descendants(int(child))]
    return found


class DeltaFactory:
    """Deltas against the served model's own checkpoint, written under the server's root."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.base = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            self.base.update(load_file(shard))
        self.root = root
        self._prefix = uuid.uuid4().hex[:8]  # the root is shared by the session's modules
        self._count = 0

    def fresh_dir(self, label: str) -> Path:
        self._count += 1
        return self.root / f"{self._prefix}-{self._count:03d}-{label}"

    def perturbed(self, names: list[str], seed: int, density: float = 0.05) -> dict[str, torch.Tensor]:
        """New values for `names`: a random `density` of elements moved by one ULP."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name in names:
            t = self.base[name].clone()
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.shape, generator=gen) < density] += 1
            out[name] = t
        return out

    def write(
        self,
        label: str,
        new: dict[str, torch.Tensor],
        *,
        version: int = 1,
        base_version: int | None = 0,
        encoding: str = "ulp_zstd",
        old: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """A finished delta from `old` (default: the checkpoint) to `new`; returns its directory."""
        old = old or self.base
        out = self.fresh_dir(label)
        with DeltaWriter(out, version=version, base_version=base_version, encoding=encoding) as writer:
            for name, t in new.items():
                d = diff_param(t, old[name])
                writer.add(
                    name, d.positions, d.new_values, d.old_values, shape=t.shape, post_hash=tensor_digest(t)
                )
        return out

    def raw(
        self,
        label: str,
        name: str,
        shape: tuple[int, ...],
        positions: list[int],
        values: torch.Tensor,
        *,
        encoding: str = "ulp_zstd",
        version: int = 1,
        base_version: int | None = 0,
    ) -> Path:
        """A delta that states `shape` and `values` as given, whatever the model has."""
        out = self.fresh_dir(label)
        pos = torch.tensor(positions, dtype=torch.int64)
        old = values.clone()
        old.view(torch.uint8)[:: values.element_size()] ^= 1  # every old value differs (low bit, LE)
        with DeltaWriter(out, version=version, base_version=base_version, encoding=encoding) as writer:
            writer.add(name, pos, values, old, shape=shape)
        return out


@pytest.fixture(scope="module")
def paired_server(engine_pair) -> DeltaServer:
    """The first engine of the session's engine pair (harness/engine_pair.py: a body cap, a collective
    allowlist), back on its checkpoint, for a module that needs those flags. Its root is the pair's:
    such a module takes `delta_root` from the pair too."""
    return DeltaServer(engine_pair.on_checkpoint()[0], engine_pair.root)


@pytest.fixture(name="child_environ", scope="session")
def child_environ_fixture():
    """`child_environ(server)`: the environment of the engine processes a `VllmServer` started."""
    return child_environ


@pytest.fixture(scope="module")
def delta_root(engine_pool) -> Path:
    return engine_pool.delta_root()


@pytest.fixture(scope="module")
def delta_server(engine_pool, tiny_model_factory, delta_root: Path) -> DeltaServer:
    """The session's shared `vllm serve` of the tiny Llama, started as a user starts it with delta updates
    and an API key, back on its checkpoint (at whatever version the modules before this one reached)."""
    model_dir = tiny_model_factory("llama")
    server = engine_pool.shared_llama(model_dir)
    reset_to_checkpoint(server, delta_root, model_dir)
    return DeltaServer(server, delta_root)


@pytest.fixture(scope="module")
def deltas(tiny_model_factory, delta_root: Path) -> DeltaFactory:
    return DeltaFactory(tiny_model_factory("llama"), delta_root)
