"""What a prepare stages and how it is bounded: chunks of (offset, value) writes per destination, the
digest sums of the changed positions, and the checks that refuse before any weight changes.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from itertools import chain, count, repeat
from operator import getitem

import numpy as np
import torch

from vllm_delta.engine.cli_args import DEFAULT_MAX_STAGED_BYTES
from vllm_delta.engine.stand_in import Prebuilt
from vllm_delta.engine.trace import PhaseTimes
from vllm_delta.kernels.digest import segment_sums
from vllm_delta.wire.codecs import ulp_resolve_tensor
from vllm_delta.wire.errors import DtypeMismatchError, IncompatibleDeltaError


@dataclass
class Chunk:
    """Writes to one destination's flat storage, staged on its device: new values in its dtype, or with
    `base`, signed ULP steps in dtype `base` resolved on the current values at commit."""

    offsets: torch.Tensor
    values: torch.Tensor
    base: torch.dtype | None = None


@dataclass
class StagedUpdate:
    """Everything `commit` needs, computed in `prepare` without touching a weight."""

    version: int
    writes: dict[str, deque[Chunk]]  # destination -> chunks, consumed (and freed) by the commit
    fallback: list[str]  # tensors staged by replaying their loader (engine/fallback.py)
    total_changed: int
    changed: int  # entries this rank writes
    bytes_read: int
    replay: bool
    decode_s: float = 0.0  # the whole prepare
    max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES  # the bound on everything staged
    staged_bytes: int = 0
    # This rank's counted-once partial sums [pre, post] of the changed positions, and the manifest's.
    digests: dict[str, list[str | None]] = field(default_factory=dict)
    expected: dict[str, list[str | None]] = field(default_factory=dict)
    # What a later full verify checks: whole-tensor additive digest / xxh3 after this update.
    after: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    anchor: bool = False  # overwrites every element of every checkpoint tensor
    blocks: tuple[int, int] = (0, 0)  # position blocks (decoded, in the delta) of block-indexed flushes
    prebuilt: Prebuilt = field(default_factory=Prebuilt)
    times: PhaseTimes = field(default_factory=PhaseTimes)  # prepare's phases, then the commit's
    run_id: str | None = None  # the sender run whose lineage the weights are on once committed

    @property
    def fallback_names(self) -> list[str]:
        return sorted(set(self.fallback))


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `t`, so storage offsets index it directly."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


def gather(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`flat[offsets]`, mixed devices refused (meta and CUDA accept CPU indices)."""
    if flat.device != offsets.device:
        raise RuntimeError(f"tensors on different devices: {sorted([str(flat.device), str(offsets.device)])}")
    return flat.index_select(0, offsets)


def host_values(scalars: list[torch.Tensor]) -> list:
    """Each 0-d tensor's value, with one device-to-host copy per device (None on meta, which holds none)."""
    out: list = [None] * len(scalars)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(scalars):
        by_device.setdefault(t.device, []).append(i)
    for device, ids in by_device.items():
        if device.type != "meta":
            for i, value in zip(ids, torch.stack([scalars[i] for i in ids]).cpu().tolist()):
                out[i] = value
    return out


def index_dtype(flat: torch.Tensor) -> torch.dtype:
    """Offsets into `flat` as int32 where it has < 2^31 elements (half the bytes), else int64."""
    return torch.int32 if flat.numel() < 1 << 31 else torch.int64


def chunk(
    canon: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, base: torch.dtype | None = None
) -> Chunk:
    """A `Chunk` at flat storage offsets of `canon`, on its device."""
    flat = flat_storage(canon)
    values = values if base is not None else values.to(canon.dtype)
    return Chunk(offsets.to(index_dtype(flat)).to(flat.device), values.to(flat.device), base)


def stage_sums(
    flat: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor | int,
    n: int,
    dtype: torch.dtype,
    needs_base: bool,
    pre: bool,
    post: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """int64[n, 2] digest lane sums per slot of the old values at `offsets` (as `dtype`; if `pre`)
    and of the new ones (`values`, or ULP steps resolved on the old; if `post`)."""
    old = gather(flat, offsets).to(dtype) if pre or needs_base else None
    new = (ulp_resolve_tensor(old, values) if needs_base else values) if post else None
    return (
        segment_sums(positions, old, slots, n) if pre else None,
        segment_sums(positions, new, slots, n) if post else None,
    )


def check_resolvable(
    target: str, served: torch.dtype, name: str, sent: torch.dtype, *, pre_digest: bool = False
) -> None:
    """Refuse (422, before any write) a base-relative step, or a pre_digest, on served values that do
    not convert back to the checkpoint's exactly: only the same dtype, or a float at least as precise
    with at least its range (bf16 served as float32; not bf16 <-> fp16)."""
    if served == sent:
        return
    if served.is_floating_point and sent.is_floating_point:
        a, b = torch.finfo(served), torch.finfo(sent)
        if a.eps <= b.eps and a.max >= b.max and a.tiny * a.eps <= b.tiny * b.eps:
            return
    what, hint = (
        ("its pre_digest cannot be checked", "send it without pre digests")
        if pre_digest
        else ("a base-relative step cannot be resolved", "send an overwrite encoding")
    )
    raise DtypeMismatchError(
        f"{target} is served as {served}, the delta's values are {sent}: {what} exactly on the served "
        f"values ({hint})",
        param=name,
    )


class StagingBoundError(IncompatibleDeltaError):
    """The staged update would exceed the receiver's bound (--delta-updates-max-staged-bytes)."""

    http_status = 413


class Staging:
    """Staged chunks per destination, refused past `bound` bytes in total (so an update never OOMs)."""

    def __init__(self, bound: int) -> None:
        self.bound, self.nbytes, self.changed = bound, 0, 0
        self.writes: dict[str, deque[Chunk]] = {}

    def add(self, target: str, chunk: Chunk, counted: bool = True) -> None:
        self.nbytes += chunk.offsets.nbytes + chunk.values.nbytes
        if self.nbytes > self.bound:
            raise StagingBoundError(
                f"the staged update needs more than --delta-updates-max-staged-bytes={self.bound} bytes "
                "(the bound on everything an update stages); send smaller updates or raise the bound",
                param=target,
            )
        if counted:
            self.changed += chunk.offsets.numel()
        self.writes.setdefault(target, deque()).append(chunk)


class Sums:
    """This rank's digest lane sums per tensor, kept on the device as rows until one copy at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[str | None], int, torch.Tensor]] = []  # (name per row, lane, int64[n, 2])

    def add_rows(self, names: list[str], lane: int, wanted: list[bool], sums: torch.Tensor) -> None:
        """Row i is tensor `names[i]`'s where `wanted[i]`, else no tensor's (None)."""
        self.rows.append((list(map(getitem, zip(repeat(None), names), wanted)), lane, sums))

    def hex(self) -> dict[str, list[str | None]]:
        """Hex digests of the tensors with rows: one device-to-host copy per device, no Python object
        per row (GC: 0.25 s at 6k); a digest no row sums is None."""
        ids = dict.fromkeys(chain.from_iterable(names for names, _, _ in self.rows))
        ids.pop(None, None)
        row_of = {**dict(zip(ids, count())), None: -1}
        total = np.zeros((len(ids), 2, 2), dtype=np.uint64)  # tensor, pre/post, the digest's two lanes
        held = np.zeros((len(ids), 2), dtype=bool)
        by_device: dict[torch.device, list[tuple[list[str | None], int, torch.Tensor]]] = {}
        for row in self.rows:
            by_device.setdefault(row[2].device, []).append(row)
        for rows in by_device.values():
            values = torch.cat([t for _, _, t in rows]).cpu().numpy().view(np.uint64)
            tensor = np.fromiter(
                map(row_of.__getitem__, chain.from_iterable(names for names, _, _ in rows)),
                dtype=np.int64,
                count=len(values),
            )
            lane = np.repeat(np.array([lane for _, lane, _ in rows]), [len(names) for names, _, _ in rows])
            keep = tensor >= 0
            np.add.at(total, (tensor[keep], lane[keep]), values[keep])  # wraps mod 2^64, as the digest does
            held[tensor[keep], lane[keep]] = True
        text = total.astype(">u8").tobytes().hex()  # to_hex's form: lane 0 then lane 1, 16 digits each
        digits = re.findall(".{32}", text)  # tensor i's pre, then its post (no Python loop a tensor)
        out = dict(zip(ids, map(list, zip(digits[0::2], digits[1::2]))))
        names = list(ids)
        for i, lane in zip(*np.nonzero(~held)):  # a digest not summed here
            out[names[i]][lane] = None
        return out
