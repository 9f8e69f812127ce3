"""Helpers for the `delta` weight-transfer backend tests: a plain PyTorch trainer, a local HF hub
cache, vLLM's routes and `/metrics`.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from vllm_delta.diff import diff_param
from vllm_delta.wire import DeltaWriter, tensor_digest

NATIVE = ["--weight-transfer-config", json.dumps({"backend": "delta"})]  # `vllm serve` args of the backend
HUB_ID = "vllm-delta-tests/tiny-llama"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(model_dir: Path, hf_home: Path) -> Path:
    """An HF cache holding `model_dir` as `HUB_ID` (what a past download leaves), for HF_HUB_OFFLINE=1."""
    repo = hf_home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


def checksums(url: str) -> dict[str, str]:
    """vLLM's own per-parameter digests (`/weight_checker`)."""
    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=120)
    r.raise_for_status()
    return r.json()["checksums"]


def merged_checksums(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """The `/weight_checker` answer from `compute_weight_checksums` results (offline `LLM`)."""
    out: dict[str, str] = {}
    for digests in per_worker:
        out.update(digests)
    return out


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Our `vllm_delta:` samples on vLLM's `/metrics`: (sample name, labels) -> value."""
    text = requests.get(f"{url}/metrics", timeout=60).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("vllm_delta:")
        for s in fam.samples
    }


def sample(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def save_trained(model, tokenizer_dir: Path, out: Path) -> Path:
    """The trainer's weights as transformers writes them, with the served tokenizer files."""
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and not (out / f.name).exists() and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)
    return out


def ulp_step(state: dict[str, torch.Tensor], seed: int, density: float = 0.05) -> None:
    """A deterministic optimizer-like step, in place: a seeded `density` of bf16 elements moves by ±1 ULP."""
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        bits = state[name].view(-1).view(torch.int16)
        mask = torch.rand(bits.shape, generator=gen) < density
        step = torch.where(torch.rand(bits.shape, generator=gen) < 0.5, 1, -1).to(torch.int16)
        bits[mask] += step[mask]


def stage_names(names: list[str], rank: int) -> set[str]:
    """A two-stage pipeline split of the tiny Llama: stage 1 holds layer 1, the final norm and lm_head."""
    last = {n for n in names if ".layers.1." in n or n.startswith(("model.norm.", "lm_head."))}
    return last if rank == 1 else set(names) - last


def stream_tokens(url: str, max_tokens: int) -> int:
    """One greedy streamed completion of `max_tokens` (EOS ignored); how many token ids arrived."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    received = 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                received += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
    return received


class Streams:
    """Streamed completions back to back on a thread until stopped, so generation is going on whenever
    an update is sent; `counts` gets each finished stream's token count."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.counts.append(stream_tokens(self.url, self.max_tokens))

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(300)


def native_update(url: str, update_info: dict, weight_version: str) -> tuple[requests.Response, dict | None]:
    """vLLM's session over its HTTP routes: start, update and (if accepted) finish; the update's
    response and the finish's `delta` report (None if refused)."""
    assert requests.post(f"{url}/start_weight_update", timeout=60).status_code == 200
    r = requests.post(f"{url}/update_weights", json={"update_info": update_info}, timeout=300)
    if r.status_code != 200:
        return r, None
    f = requests.post(f"{url}/finish_weight_update", json={"weight_version": weight_version}, timeout=300)
    assert f.status_code == 200, f.text
    return r, f.json()["delta"]


def write_delta(
    root: Path,
    label: str,
    tensors: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    version: int,
    base_version: int,
) -> Path:
    """A finished, valid delta from `base` to `tensors` (shapes as given)."""
    out = root / label
    with DeltaWriter(out, version=version, base_version=base_version, encoding="ulp_zstd") as writer:
        for name, t in tensors.items():
            d = diff_param(t, base[name])
            writer.add(
                name, d.positions, d.new_values, d.old_values, shape=t.shape, post_hash=tensor_digest(t)
            )
    return out
