"""`vllm-delta diff` run in the test process: the CLI's own code, without a Python start per delta.

Why: engine tests make many deltas (test_apply_bitexact: 15) and a `vllm-delta` process costs 2-5 s,
mostly importing torch; the console script itself stays covered by tests/wire/test_cli.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_delta.cli import main
from vllm_delta.wire import load_manifest, write_manifest
from vllm_delta.wire.additive import partial_sum, tensor_sum, to_hex


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


def _tensors(checkpoint: Path | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if not isinstance(checkpoint, Path):
        return checkpoint
    out = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def add_digests(
    delta: Path, old: Path | Mapping[str, torch.Tensor], new: Path | Mapping[str, torch.Tensor]
) -> Path:
    """State in `delta`'s manifest the additive digests a sender states (the changed positions before and
    after, the whole tensor after), from the two checkpoints (directories or their tensors), not from an
    engine: the CLI states only `post_hash`, which no commit checks."""
    old, new = _tensors(old), _tensors(new)
    manifest = load_manifest(delta)
    params = []
    for p in manifest.params:
        a, b = old[p.name].reshape(-1), new[p.name].reshape(-1)
        pos = torch.nonzero(
            a.view(torch.uint8).reshape(a.numel(), -1).ne(b.view(torch.uint8).reshape(b.numel(), -1)).any(1)
        ).squeeze(1)
        digests = {
            "pre_digest": to_hex(partial_sum(pos, a[pos])),
            "post_digest": to_hex(partial_sum(pos, b[pos])),
            "digest": to_hex(tensor_sum(b)),
        }
        params.append(p.model_copy(update=digests))
    write_manifest(delta, manifest.model_copy(update={"params": params}))
    return delta
