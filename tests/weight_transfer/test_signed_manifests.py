"""Signed manifests end to end (docs/security.md, "Signed manifests"): real engines that require them
apply what a sender signed, bit-exact with a fresh load, and refuse a forged manifest or a wrong key
with 403 before any weight changes.

One module, two engines started together, each holding two keys (NEW signs; OLD is being rotated
out): `route` (`--enable-delta-updates`, keys on the command line, collective allowed from
loopback) for our route's disk and collective transports, and `native` (vLLM's weight-transfer
backend, keys in a file) for the other door. The S3 transport's cases run on the engines of
tests/transports/test_s3_engines.py, the Megatron hook's on tests/megatron/test_engine_e2e.py's.
Each door's story is one test in phases, so it passes alone and in any order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests
import torch
from harness.fresh_load import save_checkpoint
from harness.store_engine import engine_checksums, engine_status
from harness.trainer import Trainer
from harness.vllm_engine import VllmServer, start_servers
from native_helpers import NATIVE, checksums, native_update, ulp_step, write_delta
from safetensors.torch import load_file

from vllm_delta import DeltaSender
from vllm_delta.wire import MANIFEST_NAME, load_manifest, write_manifest
from vllm_delta.wire.signing import sign

pytestmark = [pytest.mark.engine, pytest.mark.heavy]

NEW, OLD = "new-signing-key-0123456789abcdef", "old-signing-key-0123456789abcdef"
ATTACKER = "an-attackers-own-key-0123456789"
API_KEY = "signed-route-key"
FLUSH = 64 << 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """((route, its root), (native, its root))."""
    tmp = tmp_path_factory.mktemp("signed")
    roots = [tmp / "route_root", tmp / "native_root"]
    for root in roots:
        root.mkdir()
    keys = tmp / "keys"
    keys.write_text(f"# NEW signs; OLD is being rotated out\n{NEW}\n{OLD}\n")
    route_args = [
        "--enable-delta-updates", "--delta-updates-root", str(roots[0]), "--api-key", API_KEY,
        "--delta-updates-collective-trainers", "127.0.0.1", "--delta-updates-signing-key", NEW, OLD,
    ]  # fmt: skip
    native_args = [*NATIVE, "--delta-updates-root", str(roots[1])]
    native_args += ["--delta-updates-signing-key-file", str(keys)]
    route, native = start_servers(
        lambda: VllmServer(model_dir, tmp / "route.log", extra_args=route_args),
        lambda: VllmServer(model_dir, tmp / "native.log", extra_args=native_args),
    )
    with route, native:
        yield (route, roots[0]), (native, roots[1])


def refused(resp: requests.Response, message: str) -> None:
    assert resp.status_code == 403, resp.text
    error = resp.json()["error"]
    assert error["type"] == "SignatureError" and message in error["message"], error
    assert error["file"] == MANIFEST_NAME, error


def stepped(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    new = {n: t.clone() for n, t in base.items()}
    ulp_step(new, seed=seed)
    return new


def forgeries(root: Path, base: dict[str, torch.Tensor]) -> tuple[Path, dict[str, tuple[Path, str]]]:
    """A valid unsigned delta v0 -> v1 and copies of it, each wrong in one way, with the refusal's words.
    The attacker can write the root but holds no key of the engine's."""
    good = write_delta(root, "good", stepped(base, 1), base, 1, 0)
    other = write_delta(root, "other", stepped(base, 2), base, 1, 0)  # its flushes get swapped in
    out = {}

    def copy(label: str, keys: list[str] | None = None) -> Path:
        dest = root / f"forged-{label}"
        shutil.copytree(good, dest)
        if keys:
            write_manifest(dest, sign(load_manifest(dest), [k.encode() for k in keys]))
        return dest

    out["unsigned"] = (copy("unsigned"), "not signed")
    out["attacker"] = (copy("attacker", [ATTACKER]), "not one of this engine's signing keys")
    d = copy("byte", [NEW])  # a signed manifest with one count changed
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["params"][0]["changed"] += 1
    (d / MANIFEST_NAME).write_text(json.dumps(raw, indent=1))
    out["byte"] = (d, "changed after signing")
    d = copy("swap", [NEW])  # another delta's flush swapped in, its hash and size in the signed manifest
    m, theirs = load_manifest(d), {f.name: f for f in load_manifest(other).files}
    victim = next(f.name for f in m.files if f.name in theirs)
    shutil.copyfile(other / victim, d / victim)
    files = [theirs[victim] if f.name == victim else f for f in m.files]
    write_manifest(d, m.model_copy(update={"files": files}))
    out["swap"] = (d, "changed after signing")
    return good, out


def test_the_route_refuses_forgeries_and_applies_signed_deltas_over_disk_and_collective(
    engines, model_dir, fresh_loader, tmp_path
):
    (route, root), _ = engines
    url = route.url
    base = load_file(model_dir / "model.safetensors")
    start = engine_status(url, API_KEY)
    assert start["version"] == 0 and start["healthy"], start
    before = engine_checksums(url, API_KEY)

    good, forged = forgeries(root, base)
    for label, (path, message) in forged.items():
        r = requests.post(
            f"{url}/update_weights_delta",
            json={"path": path.name, "version": 1, "base_version": 0},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        refused(r, message)
        assert engine_checksums(url, API_KEY) == before, f"{label}: a refused update changed the weights"
    assert engine_status(url, API_KEY)["version"] == 0

    # Rotation: the delta signed with the old key, still on the engine's list, applies.
    write_manifest(good, sign(load_manifest(good), [OLD.encode()]))
    r = requests.post(
        f"{url}/update_weights_delta",
        json={"path": good.name, "version": 1, "base_version": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text

    # A trainer over disk, signing with the new key: an anchor (the engine is on no sender's run),
    # then a delta; the engine equals a fresh load of the trainer's weights.
    trainer = Trainer(model_dir)
    trainer.model.load_state_dict(stepped(base, 1), strict=False)
    disk = DeltaSender([url], "disk", root, api_key=API_KEY, flush_bytes=FLUSH, version=1, signing_keys=[NEW])
    disk.seed(trainer.weights())
    disk.request_anchor()
    trainer.step()
    assert disk.sync(trainer.weights())["sender/all_acked"] == 1.0, disk.engines
    trainer.step()
    assert disk.sync(trainer.weights())["sender/all_acked"] == 1.0, disk.engines
    version = int(disk.version)
    disk.close()
    want = fresh_loader.checksums(save_checkpoint(trainer.state(), model_dir, tmp_path / "disk"))
    assert engine_checksums(url, API_KEY) == want

    # Collective: a sender with the wrong key is refused in the handshake, before any flush moves.
    def gloo(keys: list[str], at: int) -> DeltaSender:
        sender = DeltaSender(
            [url], "gloo", api_key=API_KEY, flush_bytes=FLUSH, version=at, collective_timeout_s=60,
            signing_keys=keys,
        )  # fmt: skip
        sender.seed(trainer.weights())
        sender.request_anchor()  # another run than the disk sender's: only an anchor proves the weights
        return sender

    wrong = gloo([ATTACKER], version)
    trainer.step()
    m = wrong.sync(trainer.weights())
    link = wrong.transport.link(url, None)
    assert m["sender/all_acked"] == 0.0 and wrong.engines[url].last_status == 403, wrong.engines
    assert link.refusal["type"] == "SignatureError" and link.bytes_sent == 0, link.refusal
    wrong.close()
    assert engine_checksums(url, API_KEY) == want and engine_status(url, API_KEY)["version"] == version

    right = gloo([NEW, OLD], version)
    assert right.sync(trainer.weights())["sender/all_acked"] == 1.0, right.engines
    right.close()
    want = fresh_loader.checksums(save_checkpoint(trainer.state(), model_dir, tmp_path / "gloo"))
    assert engine_checksums(url, API_KEY) == want
    assert engine_status(url, API_KEY)["healthy"]


def test_the_weight_transfer_door_refuses_forgeries_and_a_wrong_key_and_applies_a_signed_sync(
    engines, model_dir, fresh_loader, tmp_path
):
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_delta import DeltaTrainerInitInfo

    _, (native, root) = engines
    url = native.url
    base = load_file(model_dir / "model.safetensors")
    before = checksums(url)
    _, forged = forgeries(root, base)
    for label, (path, message) in forged.items():
        r, done = native_update(url, {"path": path.name, "version": 1, "base_version": 0}, "forged")
        refused(r, message)
        assert done is None and checksums(url) == before, f"{label}: a refused update changed the weights"

    def trainer_engine(keys: list[str], trainer: Trainer):
        return WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(
                delta_dir=str(root), flush_bytes=FLUSH, rank=0, signing_keys=keys, checkpoint=str(model_dir)
            ),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(trainer.model),
        )

    trainer = Trainer(model_dir)
    trainer.step()
    wrong = trainer_engine([ATTACKER], trainer)
    metrics = wrong.send_weights()
    assert metrics["sender/all_acked"] == 0.0 and wrong.sender.engines[url].last_status == 403
    assert wrong.sender.engines[url].last_error["type"] == "SignatureError", wrong.sender.engines
    wrong.shutdown()
    assert checksums(url) == before

    right = trainer_engine([NEW], trainer)
    assert right.send_weights()["sender/all_acked"] == 1.0, right.sender.engines
    right.shutdown()
    want = fresh_loader.checksums(save_checkpoint(trainer.state(), model_dir, tmp_path / "native"))
    assert checksums(url) == want
