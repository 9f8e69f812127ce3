"""Write the golden files of tests/wire/test_golden.py from its fixed inputs.

Run by hand only, after a deliberate format change (`.venv/bin/python tests/wire/golden/make_golden.py`),
and commit the result with a note saying what changed; the suite never runs this.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]  # tests/wire (test_golden, wire_helpers), tests

from test_golden import CASES, FLUSH, case_dir, seed_bytes, write_ours  # noqa: E402


def main() -> None:
    for layout, encoding in CASES:
        out = HERE / case_dir(layout, encoding)
        shutil.rmtree(out, ignore_errors=True)
        if layout == "seed":
            out.mkdir()
            (out / FLUSH).write_bytes(seed_bytes(encoding))
        else:
            write_ours(out, layout, encoding)
        print(out.name, sorted(f"{p.name}:{p.stat().st_size}" for p in out.iterdir()))


if __name__ == "__main__":
    main()
