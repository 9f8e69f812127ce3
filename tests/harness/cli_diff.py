"""`vllm-delta diff` run in the test process: the CLI's own code, without a Python start per delta.

Why: engine tests make many deltas (test_apply_bitexact: 15) and a `vllm-delta` process costs 2-5 s,
mostly importing torch; the console script itself stays covered by tests/wire/test_cli.py."""

from __future__ import annotations

from pathlib import Path

from vllm_delta.cli import main


def diff(
    old: Path, new: Path, out: Path, encoding: str, version: int, base_version: int | None = None
) -> Path:
    """The delta from checkpoint `old` to `new` at `version` (on `base_version`, if stated) into `out`."""
    argv = ["diff", str(old), str(new), str(out), "--encoding", encoding, "--version", str(version)]
    if base_version is not None:
        argv += ["--base-version", str(base_version)]
    if main(argv) != 0:
        raise RuntimeError(f"vllm-delta {' '.join(argv)} failed (its error is on stderr)")
    return out
