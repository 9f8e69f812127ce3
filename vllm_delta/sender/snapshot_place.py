"""Where a sender's snapshot lives: beside the parameters ("device") or in pinned host memory ("host").

Why a rule for "auto": the device copy is the fastest scan (no bus crossing) but costs one more
parameter's worth of device memory, which a trainer may need once its optimizer state exists. So
"auto" takes the device only when the snapshot, the optimizer state still to be allocated and a
safety margin fit in its free memory, and says why it chose either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_delta.sender.shards import Shard

SNAPSHOT_PLACES = ("auto", "device", "host")
# "auto": what the trainer may still allocate on the device after registration. Registration comes
# before the first step, so Adam's two fp32 moments (8 B per param; not DP-sharded: the worst case)
# do not exist yet; activations and allocator fragmentation get a margin of the device's memory.
OPTIMIZER_BYTES_PER_PARAM = 8
MARGIN_FRACTION = 0.15


def choose_place(mode: str, shards: Sequence[Shard]) -> tuple[str, str]:
    """("device" or "host", why) for the snapshot of `shards` under `mode` (one of SNAPSHOT_PLACES)."""
    if mode != "auto":
        return mode, "chosen explicitly"
    devices = {s.tensor.device for s in shards}
    if not any(d.type == "cuda" for d in devices):
        return "device", "the weights are not on a GPU (the two places are the same memory)"
    need = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
    params = sum(s.tensor.numel() for s in shards)
    free, total = (min(x) for x in zip(*(torch.cuda.mem_get_info(d) for d in devices if d.type == "cuda")))
    return place_snapshot(need, params, free, total)


def place_snapshot(snapshot_bytes: int, params: int, free: int, total: int) -> tuple[str, str]:
    """The "auto" rule: the device only if the snapshot, the optimizer state not yet allocated
    (OPTIMIZER_BYTES_PER_PARAM) and a margin (MARGIN_FRACTION of the device) fit in its free memory."""
    optimizer = OPTIMIZER_BYTES_PER_PARAM * params
    margin = int(MARGIN_FRACTION * total)
    fits = snapshot_bytes + optimizer + margin <= free
    gib = 1 << 30
    why = (
        f"snapshot {snapshot_bytes / gib:.1f} GiB + optimizer state {optimizer / gib:.1f} GiB + margin "
        f"{margin / gib:.1f} GiB {'<=' if fits else '>'} free {free / gib:.1f} GiB"
    )
    return ("device" if fits else "host"), why
