"""The seed trainer's flushes and push body, held to what the seed's own code produces and sends.

The digests below are of flushes made by the seed's own encoder (slime's delta sync at the commit
before its rewrite, 76510d769: `encode_indices`/`encode_deltas`, `DeltaBucket`, its writer's
`safetensors.torch.save` and zstd level 1) on `harness.seed_inputs.seed_case()`. They digest the
content (metadata, tensor dtypes, shapes and bytes): safetensors writes its header from a hash
map, so even the seed's own bytes differ from run to run. `harness.seed_trainer` must produce the
same content, and our reader must decode it to the trainer's exact weights.
"""

from __future__ import annotations

import pytest
import torch
from harness.seed_inputs import seed_case
from harness.seed_trainer import content_digest, flush_bytes

from vllm_delta.engine.routes import SeedPush
from vllm_delta.wire import read_delta

SEED_ENCODER = {
    "indices": "601d4d57d65665dceacb491c94fb19534e02088b1570e08553c4257dba5f09e1",
    "deltas": "4b6856bb6084b880073c61cc7501a661d00275bad8cf9ec4896d0163e2eb51ce",
    "deltas_zstd": "09f161fb0884bb075819f53491d597b5906756509674b48959d65f0608d39435",
}
INT = {2: torch.int16, 4: torch.int32}


@pytest.mark.parametrize("encoding", sorted(SEED_ENCODER))
def test_flush_content_equals_the_seed_encoders(tmp_path, encoding):
    data = flush_bytes(seed_case(), encoding=encoding, version=3)
    assert content_digest(data) == SEED_ENCODER[encoding]
    assert (data[:4] == b"\x28\xb5\x2f\xfd") == (
        encoding == "deltas_zstd"
    )  # the seed's whole-file zstd frame
    (tmp_path / "rank0000_flush000000.safetensors").write_bytes(data)
    changes = [c for chunk in seed_case() for c in chunk]
    out = {name: old.clone() for name, old, _ in changes}
    for pd in read_delta(tmp_path, allow_seed=True, files=["rank0000_flush000000.safetensors"]):
        pd.apply_(out[pd.name])
    for name, _, new in changes:
        bits = INT[new.element_size()]
        assert torch.equal(out[name].view(bits), new.view(bits)), name


def test_the_seeds_push_body_is_our_update():
    """The body of slime's `update_weights_from_disk(model_path, files=..., load_format="delta",
    weight_version=...)`, as its `_make_request` posts it."""
    body = {
        "model_path": "/shared/fs/delta-updates/weight_v000007",
        "load_format": "delta",
        "weight_version": "7",
        "files": ["rank0000_flush000000.safetensors", "rank0001_flush000000.safetensors"],
    }
    update = SeedPush.model_validate(body).as_update()
    assert (update.path, update.version, update.base_version, update.files) == (
        body["model_path"],
        7,
        None,
        body["files"],
    )


@pytest.mark.parametrize(
    "change",
    [
        {"load_format": "auto"},  # a full reload: not ours to serve
        {"weight_version": "v7"},
        {"weight_version": 7},  # the seed sends a string
        {"files": []},  # the seed's receiver needs a non-empty list too
        {"files": None},
        {"abort_all_requests": True},
        {"model_path": ""},
    ],
)
def test_bad_push_bodies_are_refused(change):
    body = {"model_path": "/d/weight_v000001", "load_format": "delta", "weight_version": "1", "files": ["f"]}
    with pytest.raises(ValueError):
        SeedPush.model_validate({**body, **change}).as_update()
