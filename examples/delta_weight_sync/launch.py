#!/usr/bin/env python3
"""16-node launcher (8 Megatron trainer nodes + 8 vLLM rollout nodes) for delta weight sync.

This project's counterpart of the seed's GLM-4.7-355B-A32B launcher. Rollout nodes run
`vllm serve --enable-delta-updates` on a shared delta root; trainer nodes run the user's Megatron
training script under torchrun with the parallel layout and the delta flags, which the script
turns into a `DeltaSender` and `megatron_hook.register(...)` (examples/delta_weight_sync/README.md).
It cannot run on this machine: `--dry-run` prints every node's command, and is tested.
Without `--dry-run` it executes the command of `--node` (run it once per node, e.g. from a scheduler).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Parallel layout of the trainer; checked against the node count at parse time."""

    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    ep: int
    etp: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self) -> None:
        if self.world % (self.tp * self.pp):
            raise SystemExit(f"TP*PP={self.tp * self.pp} does not divide {self.world} GPUs")
        if (self.world // self.pp) % (self.ep * self.etp):
            raise SystemExit(
                f"EP*ETP={self.ep * self.etp} does not divide {self.world // self.pp} GPUs per stage"
            )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print every node's command and exit")
    ap.add_argument("--node", default=None, help="run this node's command (trainer-N or rollout-N)")
    ap.add_argument(
        "--model", default="zai-org/GLM-4.7", help="HF checkpoint every engine serves (version 0)"
    )
    ap.add_argument("--trainer-nodes", type=int, default=8)
    ap.add_argument("--rollout-nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--trainer-host", default="trainer-{i}", help="host name pattern of trainer node i")
    ap.add_argument("--rollout-host", default="rollout-{i}", help="host name pattern of rollout node i")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=16)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--engine-tp", type=int, default=8)
    ap.add_argument(
        "--train-script",
        default="pretrain_gpt_rl.py",
        help="your Megatron training script (it reads the --delta-* flags, see README)",
    )
    ap.add_argument("--delta-mode", choices=["delta", "full"], default="delta")
    ap.add_argument(
        "--delta-transport",
        choices=["disk"],
        default="disk",
        help="multi-rank Megatron senders use the disk transport",
    )
    ap.add_argument("--delta-encoding", default="ulp_zstd")
    ap.add_argument(
        "--delta-dir",
        default="/shared/fs/delta-updates",
        help="shared filesystem root: trainers write here, engines read it (--delta-updates-root)",
    )
    ap.add_argument("--flush-bytes", type=int, default=512 << 20)
    ap.add_argument(
        "--max-staged-bytes", type=int, default=2 << 30, help="engine: --delta-updates-max-staged-bytes"
    )
    ap.add_argument(
        "--api-key-env",
        default="VLLM_DELTA_API_KEY",
        help="environment variable holding the engines' API key (never printed)",
    )
    args = ap.parse_args(argv)
    Layout(args.trainer_nodes, args.gpus_per_node, args.tp, args.pp, args.ep, args.etp).check()
    return args


def rollout_command(args: argparse.Namespace) -> list[str]:
    return [
        "vllm",
        "serve",
        args.model,
        "--host",
        "0.0.0.0",
        "--port",
        str(args.port),
        "--tensor-parallel-size",
        str(args.engine_tp),
        "--dtype",
        "bfloat16",
        "--enable-delta-updates",
        "--delta-updates-root",
        args.delta_dir,
        "--delta-updates-max-staged-bytes",
        str(args.max_staged_bytes),
        "--api-key",
        f"${args.api_key_env}",
    ]


def engine_urls(args: argparse.Namespace) -> list[str]:
    return [f"http://{args.rollout_host.format(i=i)}:{args.port}" for i in range(args.rollout_nodes)]


def trainer_command(args: argparse.Namespace, node: int) -> list[str]:
    return [
        "torchrun",
        "--nnodes",
        str(args.trainer_nodes),
        "--nproc-per-node",
        str(args.gpus_per_node),
        "--node-rank",
        str(node),
        "--master-addr",
        args.trainer_host.format(i=0),
        "--master-port",
        "29500",
        args.train_script,
        "--tensor-model-parallel-size",
        str(args.tp),
        "--pipeline-model-parallel-size",
        str(args.pp),
        "--expert-model-parallel-size",
        str(args.ep),
        "--expert-tensor-parallel-size",
        str(args.etp),
        "--use-distributed-optimizer",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        "--bf16",
        "--hf-checkpoint",
        args.model,
        "--delta-mode",
        args.delta_mode,
        "--delta-transport",
        args.delta_transport,
        "--delta-encoding",
        args.delta_encoding,
        "--delta-dir",
        args.delta_dir,
        "--delta-flush-bytes",
        str(args.flush_bytes),
        "--delta-engines",
        ",".join(engine_urls(args)),
        "--delta-api-key-env",
        args.api_key_env,
    ]


def plan(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """{node name: (host, command)}; rollout nodes first (trainers seed from what they serve)."""
    nodes = {
        f"rollout-{i}": (args.rollout_host.format(i=i), rollout_command(args))
        for i in range(args.rollout_nodes)
    }
    nodes.update(
        {
            f"trainer-{i}": (args.trainer_host.format(i=i), trainer_command(args, i))
            for i in range(args.trainer_nodes)
        }
    )
    return nodes


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    nodes = plan(args)
    if args.dry_run:
        for name, (host, cmd) in nodes.items():
            print(
                f"[{name} @ {host}] {' '.join(shlex.quote(c) if not c.startswith('$') else c for c in cmd)}"
            )
        return 0
    if args.node not in nodes:
        raise SystemExit(f"--node must be one of {sorted(nodes)} (or use --dry-run)")
    _, cmd = nodes[args.node]
    cmd = [os.path.expandvars(c) for c in cmd]
    os.execvp(cmd[0], cmd)
    return 1


if __name__ == "__main__":
    sys.exit(main())
