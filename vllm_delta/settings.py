"""Every `VLLM_DELTA_*` environment variable: its name, and the one function that reads it, so no two
readers drift (defaults, what counts as "off"). Standard library only: every process may import it."""

from __future__ import annotations

import os

# "1": delta updates are on (`--enable-delta-updates` sets it before vLLM starts its workers).
UPDATES = "VLLM_DELTA_UPDATES"
# The largest single flush (1 GiB unset) an engine takes over a collective (it decodes one at a time).
COLLECTIVE_MAX_FLUSH_BYTES = "VLLM_DELTA_COLLECTIVE_MAX_FLUSH_BYTES"
# The only directory (or s3:// prefix) the engine reads deltas from; `--delta-updates-root` exports it.
UPDATES_ROOT = "VLLM_DELTA_UPDATES_ROOT"
# "1": manifest-less deltas in the seed's format are accepted (`--delta-updates-allow-seed-format`).
ALLOW_SEED_FORMAT = "VLLM_DELTA_ALLOW_SEED_FORMAT"
# "0" runs the numpy/torch code in place of every compiled kernel (vllm_delta/kernels/); the per-area
# names of earlier releases are aliases that do the same.
KERNELS = "VLLM_DELTA_KERNELS"
KERNELS_ALIASES = ("VLLM_DELTA_APPLY_KERNEL", "VLLM_DELTA_SCAN_KERNEL", "VLLM_DELTA_ENCODE_KERNEL")
# The keys a manifest may be signed with (wire/signing.py): comma-separated, or a file of one a line (`#`
# comments), read at every use so a rotation needs no restart. The first signs; any verifies.
SIGNING_KEYS = "VLLM_DELTA_SIGNING_KEYS"
SIGNING_KEY_FILE = "VLLM_DELTA_SIGNING_KEY_FILE"


def updates_enabled() -> bool:
    return os.environ.get(UPDATES) == "1"


def collective_max_flush_bytes() -> int:
    return int(os.environ.get(COLLECTIVE_MAX_FLUSH_BYTES) or 1 << 30)


def updates_root() -> str:
    """This engine's delta root ("" when none was given)."""
    return os.environ.get(UPDATES_ROOT, "")


def allow_seed_format() -> bool:
    return os.environ.get(ALLOW_SEED_FORMAT) == "1"


def kernels_on() -> bool:
    """The compiled kernels are not switched off (read on every call: tests and benchmarks flip it)."""
    return all(os.environ.get(v, "1") != "0" for v in (KERNELS, *KERNELS_ALIASES))


def signing_keys() -> list[str]:
    """The configured signing keys ([]: manifests are neither signed nor checked); a key file that is
    gone, unreadable or lists no key raises (fail closed)."""
    path = os.environ.get(SIGNING_KEY_FILE)
    if path:
        with open(path, encoding="utf-8") as f:
            keys = [line for line in map(str.strip, f) if line and not line.startswith("#")]
        if not keys:
            raise ValueError(f"the signing key file {path} lists no key")
        return keys
    return [k.strip() for k in os.environ.get(SIGNING_KEYS, "").split(",") if k.strip()]
