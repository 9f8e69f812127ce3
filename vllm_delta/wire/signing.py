"""Signed manifests: HMAC-SHA-256 over a manifest's canonical bytes, checked before any flush is read. The
manifest lists every flush's hash and every param's digests, so signing it binds every byte applied; the
first key of a list signs, a receiver accepts any of its list (rotation)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

from .errors import SignatureError
from .manifest import MANIFEST_NAME, Manifest, Signature

ALG = "hmac-sha256"
MIN_KEY_BYTES = 16  # 128 bits, as given; a random key of 32 hex digits or more


def canonical_bytes(manifest: Manifest) -> bytes:
    """What is signed: every field but `signature`, as sorted-key compact ASCII JSON, whatever the wire's
    serialization (the models' own fields, JSON types once validated: ~5x faster than `model_dump`)."""
    content = {k: v for k, v in manifest.__dict__.items() if k != "signature"}  # nested models: `vars`
    return json.dumps(content, sort_keys=True, separators=(",", ":"), default=vars).encode()  # ASCII


def key_id(key: bytes) -> str:
    """A key's public name: 16 hex digits of a domain-separated SHA-256."""
    return hashlib.sha256(b"vllm-delta signing key id\0" + key).hexdigest()[:16]


def signing_keys(keys: Sequence[str | bytes]) -> list[bytes]:
    """`keys` as bytes (str as UTF-8); ValueError if one is shorter than `MIN_KEY_BYTES` or two are equal."""
    out = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
    if short := [i for i, k in enumerate(out) if len(k) < MIN_KEY_BYTES]:
        raise ValueError(f"signing key #{short[0] + 1} is shorter than {MIN_KEY_BYTES} bytes")
    if len(set(out)) != len(out):
        raise ValueError("the same signing key is listed twice")
    return out


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def sign(manifest: Manifest, keys: Sequence[bytes]) -> Manifest:
    """`manifest` signed with the first of `keys` (any signature it had is replaced)."""
    key = keys[0]
    signature = Signature(alg=ALG, key_id=key_id(key), sig=_mac(key, canonical_bytes(manifest)))
    return manifest.model_copy(update={"signature": signature})


def verify(manifest: Manifest, keys: Sequence[bytes]) -> None:
    """Refuse (403 `SignatureError`) a manifest not signed by one of `keys`; no keys: nothing to check."""
    if not keys:
        return
    s = manifest.signature
    if s is None:
        raise SignatureError(
            "the manifest is not signed; this engine applies only manifests signed with one of its "
            "--delta-updates-signing-key keys",
            file=MANIFEST_NAME,
        )
    if s.alg != ALG:
        raise SignatureError(f"signature algorithm {s.alg!r} is not {ALG!r}", file=MANIFEST_NAME)
    key = next((k for k in keys if hmac.compare_digest(key_id(k), s.key_id)), None)
    if key is None:
        raise SignatureError(
            f"signed with key {s.key_id!r}, which is not one of this engine's signing keys",
            file=MANIFEST_NAME,
        )
    if not hmac.compare_digest(_mac(key, canonical_bytes(manifest)), s.sig):
        raise SignatureError(
            f"the signature does not match the manifest's content (key {s.key_id!r}): it was changed "
            "after signing",
            file=MANIFEST_NAME,
        )
