"""Multi-rank plumbing for senders whose ranks each hold part of the model (no-ops for one rank).

Why a dedicated group: a publish runs its collectives (manifest gather, reply broadcast) on a
background thread while the trainer's own collectives run on the main one. Two threads issuing
collectives on one process group can interleave differently on different ranks, so the sender
must be given a group of its own (`torch.distributed.new_group(backend="gloo")`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Ranks:
    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def bcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` on rank 0 (an empty list elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out if self.rank == 0 else []

    def any(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set: every rank calls it at the same point, whatever happened
        on it, so a step that failed on one rank ends on all of them instead of leaving the others
        waiting in the next collective."""
        return self.all_sum(int(bool(flag))) > 0

    def all_sum(self, n: int) -> int:
        if self.group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t[0])

    def send_bytes(self, data: bytes, dst: int) -> None:
        """Point-to-point bytes to group rank `dst` (its size first), for `recv_bytes`."""
        peer = dist.get_global_rank(self.group, dst)
        dist.send(torch.tensor([len(data)], dtype=torch.int64), peer, group=self.group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group=self.group)

    def recv_bytes(self, src: int) -> bytes:
        """What group rank `src` sent with `send_bytes`."""
        peer = dist.get_global_rank(self.group, src)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, peer, group=self.group)
        out = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(out, peer, group=self.group)
        return out.numpy().tobytes()
