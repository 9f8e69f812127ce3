"""The seed's trainer drives our engine unchanged: its `deltas_zstd` flushes under
`--update-weight-delta-dir`, its pushes to `POST /update_weights_from_disk` (one per pass of a
sync, so a version comes in parts), and its `/update_weight_version` for a sync that changed
nothing. The engine ends bit-exact with a fresh engine loaded from the trainer's own export.

The session's shared Llama engine serves the module; the trainer resumes at the engine's version
(a fresh engine is at 0, the seed's first sync is version 1). It sends the engine's API key, which
the seed's trainer cannot: an engine for it runs without `--api-key`, as vLLM's own RL routes do.
"""

from __future__ import annotations

import pytest
import requests
import torch
import zstandard
from harness.fresh_load import save_checkpoint
from harness.seed_trainer import SeedTrainer, flush_bytes

pytestmark = [pytest.mark.engine, pytest.mark.heavy]


def moved(weights: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for name in names:
        t = weights[name].clone()
        bits = t.view(-1).view(torch.int16)
        bits[torch.rand(bits.shape, generator=gen) < 0.03] += 1
        out[name] = t
    return out


def passes(old: dict, new: dict) -> list:
    """Two passes (the seed's non-expert pass, then its expert sub-pass), the first in two buckets."""
    changes = [(n, old[n], new[n]) for n in sorted(new)]
    third = len(changes) // 3
    return [[[changes[:third]], [changes[third : 2 * third]]], [[changes[2 * third :]]]]


def test_seed_trainer_syncs_our_engine_exactly(
    delta_server, deltas, fresh_loader, tiny_model_factory, tmp_path
):
    server = delta_server
    trainer = SeedTrainer(
        server.url, deltas.fresh_dir("seed-dir"), version=server.status()["version"], headers=server.headers()
    )
    names = sorted(deltas.base)
    weights = deltas.base
    new = moved(weights, names, seed=1)
    answers = trainer.sync(passes(weights, new))
    assert len(answers) == 2  # one push per pass, both of this version
    for r in answers:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is True and body["num_paused_requests"] == 0, body
    assert [p["weight_version"] for p in trainer.pushes] == [str(trainer.version)] * 2
    assert server.status()["version"] == trainer.version
    weights = new

    # A sync with no change pushes nothing: the seed bumps vLLM's recorded version itself.
    (bump,) = trainer.sync(passes(weights, weights))
    assert bump.status_code == 200 and bump.json()["new_version"] == str(trainer.version), bump.text

    new = moved(weights, names[::2], seed=2)
    for r in trainer.sync(passes(weights, new)):
        assert r.status_code == 200 and r.json()["success"], r.text
    weights = new
    assert server.status()["version"] == trainer.version
    export = save_checkpoint(weights, like=tiny_model_factory("llama"), out=tmp_path / "export")
    assert server.checksums() == fresh_loader.checksums(export)


def test_a_refused_push_answers_in_the_seeds_shape_and_changes_nothing(delta_server, deltas):
    server = delta_server
    before = server.baseline()
    version = server.status()["version"]
    trainer = SeedTrainer(server.url, deltas.fresh_dir("seed-bad"), version=version, headers=server.headers())
    version_dir = trainer.delta_dir / f"weight_v{version + 1:06d}"
    version_dir.mkdir()
    good = flush_bytes(
        passes(deltas.base, moved(deltas.base, sorted(deltas.base)[:2], seed=3))[0][0],
        encoding="deltas_zstd",
        version=version + 1,
    )
    corrupt = zstandard.ZstdDecompressor().decompress(good)
    (version_dir / "rank0000_flush000000.safetensors").write_bytes(corrupt[:-1] + bytes([corrupt[-1] ^ 1]))
    trainer.version = version + 1
    cases = [
        trainer.push(str(version_dir), ["rank0000_flush000000.safetensors"]),  # fails the seed's checksum
        trainer.push(str(version_dir), ["rank0000_flush000001.safetensors"]),  # no such file
        trainer.push("/elsewhere/weight_v000001", ["rank0000_flush000000.safetensors"]),  # outside the root
    ]
    for r in cases:
        assert r.status_code in (400, 403, 409, 422) and r.json()["success"] is False, r.text
    reload = requests.post(
        f"{server.url}/update_weights_from_disk",
        json={"model_path": str(version_dir), "load_format": "auto", "weight_version": "1", "files": ["a"]},
        headers=server.headers(),
        timeout=60,
    )
    assert reload.status_code == 400 and reload.json()["success"] is False, reload.text
    unauthorized = requests.post(f"{server.url}/update_weights_from_disk", json={}, timeout=60)
    assert unauthorized.status_code == 401 and unauthorized.json()["success"] is False
    server.assert_unharmed(before, version)
