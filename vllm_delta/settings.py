"""Every `VLLM_DELTA_*` environment variable: its name, and the one function that reads it.

Why one module: a variable read in several places drifts (defaults, what counts as "off"), and an
operator should find every knob in one file. Nothing here imports more than the standard library,
so the codec, the sender and the engine's processes all read the same values the same way.
"""

from __future__ import annotations

import os

# The only directory (or s3:// prefix) the engine reads deltas from, as its processes see it;
# `--delta-updates-root` exports it to the workers (set it by hand without the CLI patch).
UPDATES_ROOT = "VLLM_DELTA_UPDATES_ROOT"


def updates_root() -> str:
    """This engine's delta root ("" when none was given)."""
    return os.environ.get(UPDATES_ROOT, "")
