"""Signed manifests (wire/signing.py): canonical bytes, rotation, and that no change to a signed
manifest, nor a flush swapped in with its hash, verifies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from wire_helpers import model_tensors, perturb, write_delta

from vllm_delta import settings
from vllm_delta.wire import (
    MANIFEST_NAME,
    DeltaError,
    IntegrityError,
    load_manifest,
    read_delta,
    write_manifest,
)
from vllm_delta.wire.errors import SignatureError
from vllm_delta.wire.manifest import Lineage, parse_manifest
from vllm_delta.wire.signing import canonical_bytes, key_id, sign, signing_keys, verify

OLD, NEW = b"old-key-0123456789abcdef", b"new-key-0123456789abcdef"


@pytest.fixture
def delta(tmp_path) -> Path:
    """An unsigned two-flush delta with a lineage (so the signature must cover it too)."""
    old = model_tensors(0)
    out = write_delta(tmp_path / "d", old, perturb(old, 1), flush_bytes=512)
    m = load_manifest(out)
    assert len(m.files) >= 2
    lineage = Lineage(run_id="run-a", min_version=0, max_version=0)
    write_manifest(out, m.model_copy(update={"lineage": lineage}))
    return out


def signed(directory: Path, keys=(NEW, OLD)) -> Path:
    write_manifest(directory, sign(load_manifest(directory), list(keys)))
    return directory


def test_an_unsigned_manifest_keeps_its_bytes_and_a_signed_one_adds_one_field(delta):
    text = (delta / MANIFEST_NAME).read_text()
    assert "signature" not in text
    raw = json.loads((signed(delta) / MANIFEST_NAME).read_text())
    assert raw.pop("signature") == {
        "alg": "hmac-sha256",
        "key_id": key_id(NEW),
        "sig": raw_sig(delta),
    }
    assert raw == json.loads(text), "signing changed nothing else"


def raw_sig(directory: Path) -> str:
    return json.loads((directory / MANIFEST_NAME).read_text())["signature"]["sig"]


def test_canonical_bytes_ignore_layout_and_key_order_but_not_content(delta):
    m = load_manifest(delta)
    raw = json.loads((delta / MANIFEST_NAME).read_bytes())
    reordered = json.dumps(dict(reversed(list(raw.items()))), indent=4).encode()
    compact = m.model_dump_json().encode()
    assert {canonical_bytes(parse_manifest(b)) for b in (reordered, compact)} == {canonical_bytes(m)}
    dumped = m.model_dump(mode="json", exclude={"signature"})  # what the models' fields stand for
    assert canonical_bytes(m) == json.dumps(dumped, sort_keys=True, separators=(",", ":")).encode()
    assert canonical_bytes(sign(m, [NEW])) == canonical_bytes(m), "the signature is not part of it"
    other = m.model_copy(update={"version": m.version + 1})
    assert canonical_bytes(other) != canonical_bytes(m)


def test_a_signed_manifest_verifies_after_a_round_trip_through_its_file(delta):
    verify(load_manifest(signed(delta)), [NEW])
    verify(load_manifest(delta), [OLD, NEW])  # any key of the engine's list


def test_rotation_the_first_key_signs_and_an_old_signature_verifies_while_its_key_is_listed(delta):
    m = load_manifest(signed(delta, keys=[OLD]))
    assert m.signature is not None and m.signature.key_id == key_id(OLD)
    verify(m, [NEW, OLD])
    with pytest.raises(SignatureError, match="not one of this engine's signing keys"):
        verify(m, [NEW])


def test_unsigned_wrong_key_and_unknown_algorithm_are_refused_with_403(delta):
    unsigned = load_manifest(delta)
    verify(unsigned, [])  # an engine without keys checks nothing
    with pytest.raises(SignatureError, match="not signed") as err:
        verify(unsigned, [NEW])
    assert err.value.http_status == 403 and isinstance(err.value, DeltaError)
    forged = sign(unsigned, [b"an-attackers-key-0123456789"])
    with pytest.raises(SignatureError, match="not one of this engine's"):
        verify(forged, [NEW, OLD])
    # the right key id with a MAC from another key: the MAC decides
    theirs = forged.signature.model_copy(update={"key_id": key_id(NEW)})
    spoofed = forged.model_copy(update={"signature": theirs})
    with pytest.raises(SignatureError, match="changed after signing"):
        verify(spoofed, [NEW])
    other = sign(unsigned, [NEW]).signature.model_copy(update={"alg": "ed25519"})
    with pytest.raises(SignatureError, match="ed25519"):
        verify(unsigned.model_copy(update={"signature": other}), [NEW])


def test_no_single_byte_change_of_a_signed_manifest_verifies_with_other_content(delta):
    """Every byte of the file changed to two others: what still parses either verifies with the same
    content (layout only) or is refused."""
    data = (signed(delta) / MANIFEST_NAME).read_bytes()
    original = canonical_bytes(parse_manifest(data))
    refused = 0
    for i in range(len(data)):
        for b in {ord("0"), data[i] ^ 1} - {data[i]}:
            try:
                m = parse_manifest(data[:i] + bytes([b]) + data[i + 1 :])
            except DeltaError:
                continue  # not a manifest any more
            try:
                verify(m, [NEW])
            except SignatureError:
                refused += 1
                continue
            assert canonical_bytes(m) == original, f"byte {i} -> {chr(b)!r} verified with other content"
    assert refused > len(data) // 4, "many single-byte changes still parse: each of them was refused"


def test_a_flush_swapped_in_with_its_hash_breaks_the_signature_and_without_it_the_hash(delta, tmp_path):
    old = model_tensors(0)
    other = write_delta(tmp_path / "other", old, perturb(old, 2), flush_bytes=512)
    signed(delta)
    target = load_manifest(delta).files[0].name
    shutil.copyfile(other / target, delta / target)
    with pytest.raises(IntegrityError):
        read_delta(delta, current_version=0)  # the signed manifest's file hash binds the flush
    m = load_manifest(delta)
    theirs = next(f for f in load_manifest(other).files if f.name == target)
    files = [theirs if f.name == target else f for f in m.files]
    swapped = m.model_copy(update={"files": files})  # hash and size follow the flush; the signature stays
    write_manifest(delta, swapped)
    with pytest.raises(SignatureError, match="changed after signing"):
        verify(load_manifest(delta), [NEW])


def test_keys_are_checked_and_read_from_the_environment_or_a_file(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="shorter than 16"):
        signing_keys([NEW, "short"])
    with pytest.raises(ValueError, match="twice"):
        signing_keys([NEW, NEW.decode()])
    assert signing_keys(["é" * 8]) == ["é".encode() * 8]  # UTF-8 bytes count
    monkeypatch.delenv(settings.SIGNING_KEY_FILE, raising=False)
    monkeypatch.setenv(settings.SIGNING_KEYS, f" {NEW.decode()} ,{OLD.decode()},")
    assert settings.signing_keys() == [NEW.decode(), OLD.decode()]
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated on Monday\n{OLD.decode()}\n\n  {NEW.decode()}  \n")
    monkeypatch.setenv(settings.SIGNING_KEY_FILE, str(keys))
    assert settings.signing_keys() == [OLD.decode(), NEW.decode()], "the file wins; comments skipped"
    keys.write_text("# emptied by mistake\n")
    with pytest.raises(ValueError, match="lists no key"):  # fail closed: no update verifies
        settings.signing_keys()
    keys.unlink()
    with pytest.raises(FileNotFoundError):
        settings.signing_keys()
