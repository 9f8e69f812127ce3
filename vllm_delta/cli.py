"""`vllm-delta`: offline tools for deltas (diff, apply, inspect, verify, encodings)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_delta.diff import diff_param
from vllm_delta.wire import (
    DEFAULT_ENCODING,
    ENCODINGS,
    DeltaError,
    DeltaInfo,
    DeltaWriter,
    IntegrityError,
    ParamDelta,
    open_delta,
    read_delta,
    tensor_digest,
)
from vllm_delta.wire.checkpoint import Checkpoint, staged_dir


def cmd_diff(a: argparse.Namespace) -> None:
    old, new = Checkpoint.open(a.old), Checkpoint.open(a.new)
    if set(old.meta) != set(new.meta):
        raise ValueError(f"tensor names differ: {sorted(set(old.meta) ^ set(new.meta))[:5]}")
    if bad := [k for k in new.meta if new.meta[k] != old.meta[k]]:
        raise ValueError(f"shape or dtype differs for {bad[:5]}")
    base = a.version - 1 if a.base_version is None else a.base_version
    opts = {"encoding": a.encoding, "flush_bytes": a.flush_bytes, "model_elements": new.elements}
    with staged_dir(a.out) as tmp, DeltaWriter(tmp, version=a.version, base_version=base, **opts) as w:
        for name, t in new.iter_tensors():
            d = diff_param(t, old.read(name))
            w.add(name, d.positions, d.new_values, d.old_values, shape=t.shape, post_hash=tensor_digest(t))
    s = summarize(open_delta(a.out))
    per = f"{s['bytes_per_changed']:.3f} B per change"
    print(f"wrote {a.out}: {s['changed']} changed elements, {s['bytes']} B ({per}, {a.encoding})")


def _apply(base: Checkpoint, info: DeltaInfo, out: Path | None) -> int:
    """Apply to every shard (one in memory at a time), check post-apply hashes, maybe save. The user
    vouches that BASE is the delta's base; the post-apply hashes check that claim."""
    deltas: dict[str, list[ParamDelta]] = defaultdict(list)
    for pd in read_delta(info, expected=base.meta, current_version=info.manifest.base_version):
        deltas[pd.name].append(pd)
    hashes = {p.name: p.post_hash for p in info.manifest.params}
    for shard in base.shards:
        tensors = load_file(base.path / shard)
        for name, t in tensors.items():
            for pd in deltas.get(name, ()):
                pd.apply_(t)
            if hashes.get(name) and tensor_digest(t) != hashes[name]:
                raise IntegrityError("tensor after apply does not match post_hash", param=name)
        if out is not None:
            save_file(tensors, str(out / shard), metadata=base.shard_metadata(shard))
    return len(deltas)


def cmd_apply(a: argparse.Namespace) -> None:
    base, info = Checkpoint.open(a.base), open_delta(a.delta, allow_seed=a.allow_seed_format)
    with staged_dir(a.out) as tmp:
        base.copy_other_files(tmp)
        n = _apply(base, info, tmp)
    print(f"wrote {a.out}: {n} params changed by version {info.manifest.version}")


def summarize(info: DeltaInfo) -> dict:
    m = info.manifest
    elements = m.model_elements
    if elements is None:
        elements = sum(torch.Size(p.shape).numel() for p in m.params)
    per = lambda b, c: b / c if c else None  # noqa: E731
    keep = {"name", "bytes", "changed", "hash"}  # of each file entry
    return {
        "path": str(info.path),
        "format": "seed" if info.seed else m.format,
        "version": m.version,
        "base_version": m.base_version,
        "encoding": m.encoding,
        "idempotent": info.encoding.idempotent,
        "needs_base": info.encoding.needs_base,
        "params": len(m.params),
        "changed": m.changed,
        "elements": elements,
        "elements_scope": "model" if m.model_elements is not None else "changed_params",
        "density": m.changed / elements if elements else 0.0,
        "bytes": m.total_bytes,
        "bytes_per_changed": per(m.total_bytes, m.changed),
        "files": [
            {**f.model_dump(include=keep), "bytes_per_changed": per(f.bytes, f.changed)} for f in m.files
        ],
    }


def _table(rows: list[tuple]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(map(len, col)) for col in zip(*cells)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def cmd_inspect(a: argparse.Namespace) -> None:
    s = summarize(open_delta(a.delta, allow_seed=a.allow_seed_format))
    if a.json:
        print(json.dumps(s, indent=1))
        return
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    keys = ("path", "format", "version", "base_version", "encoding", "idempotent", "needs_base", "params")
    head = [(k, s[k]) for k in keys]
    head += [("changed / elements", f"{s['changed']:,} / {s['elements']:,} ({s['elements_scope']})")]
    head += [("density", f"{s['density']:.4%}")]
    files = [("file", "bytes", "changed", "B / changed")]
    files += [
        (f["name"], f"{f['bytes']:,}", f"{f['changed']:,}", fmt(f["bytes_per_changed"])) for f in s["files"]
    ]
    files += [("total", f"{s['bytes']:,}", f"{s['changed']:,}", fmt(s["bytes_per_changed"]))]
    print(_table(head) + "\n\n" + _table(files))


def cmd_verify(a: argparse.Namespace) -> int:
    try:
        info = open_delta(a.delta, allow_seed=a.allow_seed_format)
        if a.base:
            _apply(Checkpoint.open(a.base), info, None)
        else:
            read_delta(info, current_version=info.manifest.base_version)
    except (DeltaError, OSError, ValueError) as e:
        print(f"invalid: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    checked = " and post-apply hashes against the base" if a.base else ""
    print(f"ok: version {info.manifest.version}, {info.manifest.changed} changes{checked}")
    return 0


def cmd_encodings(a: argparse.Namespace) -> None:
    rows = [e.describe() for e in ENCODINGS.values()]
    cols = ("name", "idempotent", "needs_base", "compression", "description")
    table = [cols, *(tuple(r[c] for c in cols) for r in rows)]
    print(json.dumps(rows, indent=1) if a.json else _table(table))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-delta", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def command(func, help: str, *paths: str) -> argparse.ArgumentParser:  # `vllm-delta <func name>`
        c = sub.add_parser(func.__name__.removeprefix("cmd_"), help=help)
        for name in paths:
            c.add_argument(name, type=Path)
        c.set_defaults(func=func)
        return c

    d = command(cmd_diff, "write the delta between two HF checkpoint directories", "old", "new", "out")
    d.add_argument("--encoding", default=DEFAULT_ENCODING, choices=sorted(ENCODINGS))
    d.add_argument("--version", type=int, default=1)
    d.add_argument("--base-version", type=int, default=None, help="default: version - 1")
    d.add_argument("--flush-bytes", type=int, default=256 << 20)
    ap = command(cmd_apply, "write BASE + DELTA as a full HF checkpoint directory", "base", "delta", "out")
    i = command(cmd_inspect, "describe a delta", "delta")
    v = command(cmd_verify, "exit 0 if a delta is valid (and applies to --base), else 1", "delta")
    v.add_argument("--base", type=Path)
    seed = "also read a manifest-less seed-format delta (its checksum misses swapped values)"
    for reads in (ap, i, v):
        reads.add_argument("--allow-seed-format", action="store_true", help=seed)
    for listing in (i, command(cmd_encodings, "list encodings")):
        listing.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (DeltaError, OSError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
