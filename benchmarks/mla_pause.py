"""The pause of a commit on the MLA test engine (tests/engine/test_mla_derived.py: a tiny DeepSeek-V3 whose
layer 0 keeps W_UV / W_UK_T as copies, layer 1 an MoE), per worker phase, medians over the timed updates.

Why: the pause should hold copies only; this shows what the commit spends (`scatter`, `read_back`,
`post_load`: handler swaps, derived copies, and the steps re-run in the pause) and what prepare's
`prebuild` took on instead. Each update moves 2% of every tensor and rewrites every `kv_b_proj`.
The engine imports whichever `vllm_delta` PYTHONPATH puts first, so two trees compare as:

    PYTHONPATH=TREE:TREE/tests taskset -c 1 python benchmarks/mla_pause.py --updates 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    from engine.test_mla_derived import BACKEND, make_tiny_mla, train_step
    from harness.cli_diff import diff
    from harness.post_load_steps_mla_worker import EXTENSION
    from harness.vllm_engine import start_llm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3, help="timed updates, after one warm-up update")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mla_pause_"))
    ckpts = [make_tiny_mla(root / "v0")]
    for v in range(1, args.updates + 2):
        ckpts.append(train_step(ckpts[-1], root / f"v{v}", v))
    deltas = [
        diff(ckpts[v - 1], ckpts[v], root / f"d{v}", "ulp_zstd", v, v - 1) for v in range(1, len(ckpts))
    ]
    rows = []
    with start_llm(ckpts[0], delta=True, worker_extension_cls=EXTENSION, **BACKEND) as llm:
        for v, path in enumerate(deltas, start=1):
            request = {
                "id": f"v{v}",
                "path": str(path),
                "version": v,
                "base_version": v - 1,
                "files": None,
                "max_staged_bytes": 1 << 28,
            }
            prepared = llm.collective_rpc("delta_prepare", args=(request,))[0]
            committed = llm.collective_rpc("delta_commit", args=(request["id"],))[0]
            assert prepared["ok"] and committed["ok"], (prepared, committed)
            rows.append({**prepared["phases"], **committed["phases"], "commit": committed["apply_s"]})
        status = llm.collective_rpc("delta_status")[0]
    timed = rows[1:]
    phases = sorted({p for r in timed for p in r})
    print(json.dumps({p: round(statistics.median(r.get(p, 0.0) for r in timed), 6) for p in phases}))
    print(json.dumps({"in_pause": status["placement"].get("in_pause")}))


if __name__ == "__main__":
    main()
