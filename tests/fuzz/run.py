"""Coverage-guided fuzzing of one harness with atheris (libFuzzer): `make fuzz` runs each in turn.

    python tests/fuzz/run.py HARNESS [--seconds N] [--work DIR]

The corpus lives in `DIR/HARNESS` (seeded from our writer's output, fuzz_corpus.py, and kept
between runs, so each run starts where the last stopped). An input that fails (a `Finding`, an
exception other than the project's `DeltaError`, a crash, a timeout, the RSS limit) is copied to
tests/fuzz/regressions/HARNESS/, where tests/fuzz/test_fuzz.py replays it in the light suite. The last
line printed is a JSON summary (executions, coverage, findings, seconds) for docs/results/fuzz.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REGRESSIONS = HERE / "regressions"


def child(harness: str, corpus: Path, artifacts: Path, seconds: int, rss_mb: int) -> None:
    import atheris

    with atheris.instrument_imports(include=["vllm_delta"]):
        import fuzz_harnesses

    from fuzz_corpus import seeds

    fuzz_harnesses.warm_up({harness: seeds()[harness]})
    target = fuzz_harnesses.HARNESSES[harness]
    atheris.Setup(
        [
            sys.argv[0],
            str(corpus),
            f"-max_total_time={seconds}",
            f"-artifact_prefix={artifacts}/",
            f"-rss_limit_mb={rss_mb}",
            "-timeout=60",
            "-print_final_stats=1",
            "-max_len=65536",
        ],
        target,
    )
    atheris.Fuzz()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("harness")
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--work", type=Path, default=Path(".fuzz"))
    # libFuzzer's backstop on the whole process; atheris itself grows ~5 KB an execution (a flush run:
    # 360 MB -> 2 GB in 320 k executions, with our harness flat over the same inputs replayed), so the
    # memory check is the harness's per-input bound (fuzz_harnesses.bounded), not this.
    ap.add_argument("--rss-mb", type=int, default=3072)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    corpus = (args.work / args.harness).resolve()
    artifacts = (args.work / f"{args.harness}-artifacts").resolve()
    if args.child:
        child(args.harness, corpus, artifacts, args.seconds, args.rss_mb)
        return 0
    from fuzz_corpus import seeds

    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(seeds()[args.harness]):
        (corpus / f"seed{i:03d}").write_bytes(data)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    cmd = [sys.executable, __file__, args.harness, "--seconds", str(args.seconds), "--work", str(args.work)]
    proc = subprocess.run(
        [*cmd, "--rss-mb", str(args.rss_mb), "--child"], env=env, capture_output=True, text=True
    )
    sys.stderr.write(proc.stderr[-4000:])
    found = []
    for f in sorted(artifacts.iterdir()):
        keep = REGRESSIONS / args.harness / f.name
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, keep)
        found.append(f"{keep.relative_to(HERE.parents[1])}")
        f.unlink()
    summary = {
        "harness": args.harness,
        "seconds": round(time.monotonic() - started),
        "executions": _stat(proc.stderr, r"stat::number_of_executed_units:\s+(\d+)"),
        "coverage": _stat(proc.stderr, r"cov: (\d+)", last=True),
        "features": _stat(proc.stderr, r"ft: (\d+)", last=True),
        "corpus": len(list(corpus.iterdir())),
        "findings": found,
        "exit": proc.returncode,
    }
    print(json.dumps(summary))
    return 1 if found or proc.returncode else 0


def _stat(text: str, pattern: str, last: bool = False) -> int | None:
    hits = re.findall(pattern, text)
    return int(hits[-1] if last else hits[0]) if hits else None


if __name__ == "__main__":
    sys.exit(main())
