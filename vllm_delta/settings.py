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


# "0" runs the numpy/torch code in place of every compiled kernel (vllm_delta/kernels/); the per-area
# names of earlier releases are aliases that do the same.
KERNELS = "VLLM_DELTA_KERNELS"
KERNELS_ALIASES = ("VLLM_DELTA_APPLY_KERNEL", "VLLM_DELTA_SCAN_KERNEL", "VLLM_DELTA_ENCODE_KERNEL")


def kernels_on() -> bool:
    """The compiled kernels are not switched off (read on every call: tests and benchmarks flip it)."""
    return all(os.environ.get(v, "1") != "0" for v in (KERNELS, *KERNELS_ALIASES))
