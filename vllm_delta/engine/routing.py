"""How each checkpoint tensor goes through staging on this rank, worked out once per ownership (the
other ranks' coverage) and kept: placements are fixed after startup, so a tensor's route (replayed,
batched or masked), its segments' landings and a batch's grouping by destination recur every sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_delta.engine.batched import Group, Landing, on_device
from vllm_delta.engine.digests import Lattice, Ownership, contains
from vllm_delta.engine.placement import Segment, TensorPlacement
from vllm_delta.engine.staging import flat_storage
from vllm_delta.engine.transforms import OffsetMap
from vllm_delta.wire.deltas import DeltaBatch

# A tensor's way through `stage`: replayed through its loader, batched, or masked alone.
FALLBACK, BATCH, MASKED = 0, 1, 2
# A destination group of a batch: (target, delta dtype, needs_base, decoded on the device).
GroupKey = tuple[str, torch.dtype, bool, bool]


@dataclass(frozen=True)
class Route:
    """A tensor's kind (a fallback lands nowhere: it is replayed), element count, segments' landings,
    and whether every target is served in the checkpoint's dtype (so no `check_resolvable`)."""

    kind: int
    numel: int = 0
    landings: tuple[tuple[Segment, Landing], ...] = ()
    same: bool = True


@dataclass
class Plan:
    """A decoded batch's tensors grouped by destination as the stager groups them, and where each group's
    pieces take their entries from in the batch. `whole`: every tensor is batched (else `stage` takes it
    a tensor at a time)."""

    dtypes: list[torch.dtype]
    whole: bool = False
    odd: list[int] = field(default_factory=list)  # tensors served in another dtype on some segment: checked
    groups: list[tuple[GroupKey, object, Group]] = field(default_factory=list)  # key, value type, group
    order: np.ndarray | None = None  # int64 [pieces]: each piece's param in the batch
    bounds: list[int] = field(default_factory=list)  # group g's pieces are order[bounds[g]:bounds[g + 1]]

    @classmethod
    def of(cls, item: DeltaBatch, routes: Mapping[str, Route]) -> Plan:
        if any(name not in routes or routes[name].kind != BATCH for name in item.names):
            return cls(list(item.dtypes))
        plan, found, params = cls(list(item.dtypes), True), {}, {}
        for i, (name, dtype, vtype) in enumerate(zip(item.names, item.dtypes, item.types)):
            route = routes[name]
            if not route.same:
                plan.odd.append(i)
            for seg, landing in route.landings:
                key = (seg.target, dtype, item.needs_base, False)
                if key not in found:
                    found[key], params[key] = (vtype, Group([], [])), []
                found[key][1].add(name, seg, route.numel, landing)
                params[key].append(i)
        plan.groups = [(key, vtype, group) for key, (vtype, group) in found.items()]
        plan.order = np.array([i for p in params.values() for i in p], dtype=np.int64)
        plan.bounds = np.cumsum([0] + list(map(len, params.values()))).tolist()
        return plan


@dataclass
class Routing:
    """Routes, landings and plans of one rank's tensors, kept across syncs until the ownership changes."""

    checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    targets: Mapping[str, torch.Tensor]
    # Parameters a post-load step permuted: deltas located in the loaded layout go through these.
    offset_maps: Mapping[str, OffsetMap] = field(default_factory=dict)
    placements: dict[str, TensorPlacement] = field(default_factory=dict)
    ownership: Ownership = field(default_factory=Ownership)  # until the route hands over the other ranks'
    _routes: dict[str, Route] | None = None
    _routes_for: Ownership | None = None  # the ownership `_routes` were made for
    # Plans by (tensor names, needs_base): the last sync's, and this one's (a plan unused for a sync goes).
    _last_plans: dict[tuple, Plan] = field(default_factory=dict)
    _plans: dict[tuple, Plan] = field(default_factory=dict)
    _decode_devices: dict[str, torch.device] | None = None

    def _route(self, name: str, placement: TensorPlacement) -> Route:
        """Batched where every element held here is held once and by no lower rank (no per-element mask)."""
        if placement.fallback_reason:
            return Route(FALLBACK)
        spans = sorted((s.src_offset, s.src_last) for s in placement.segments)
        disjoint = all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
        numel = torch.Size(placement.shape).numel()
        return Route(
            BATCH if disjoint and not self.ownership.lower.get(name) else MASKED,
            numel,
            tuple((seg, Landing.of(seg, numel)) for seg in placement.segments),
            all(self.targets[seg.target].dtype == self.checkpoint[name][1] for seg in placement.segments),
        )

    def routes(self) -> dict[str, Route]:
        """Each tensor's `Route`, made once per ownership (a new one drops the plans made from the old)."""
        if self._routes is None or self._routes_for is not self.ownership:
            self._routes = {name: self._route(name, p) for name, p in self.placements.items()}
            self._routes_for, self._decode_devices = self.ownership, None
            self._last_plans, self._plans = {}, {}
        return self._routes

    def new_sync(self) -> None:
        """Plans this sync does not use again are dropped after it."""
        self._last_plans, self._plans = self._plans, {}

    def plan(self, item: DeltaBatch) -> Plan | None:
        """How a decoded batch's tensors group by destination (None: some are not batched), kept for the
        next sync, which brings the same runs."""
        routes = self.routes()
        key = (tuple(item.names), item.needs_base)
        plan = self._plans[key] if key in self._plans else self._last_plans.pop(key, None)
        if plan is None or plan.dtypes != item.dtypes:
            plan = Plan.of(item, routes)
        self._plans[key] = plan
        return plan if plan.whole else None

    def decode_devices(self) -> dict[str, torch.device]:
        """Batchable tensors whose destinations are all dense on one accelerator: decoded there."""
        routes = self.routes()
        if self._decode_devices is None:
            self._decode_devices = {}
            for name, route in routes.items():
                where = {self.targets[seg.target].device for seg, _ in route.landings}
                if route.kind == BATCH and all(land.dense for _, land in route.landings) and len(where) == 1:
                    if on_device(device := next(iter(where))):
                        self._decode_devices[name] = device
        return self._decode_devices

    def counted(self, name: str, positions: torch.Tensor, earlier: list[Lattice]) -> torch.Tensor:
        """Which of a tensor's positions this rank counts in its digests: none a lower rank holds, nor
        an `earlier` segment of its own (an element held twice counts once)."""
        keep = self.ownership.counted(name, positions)
        for lat in earlier:
            keep &= ~contains(lat, positions)
        return keep

    def permuted(self, target: str, offsets: torch.Tensor) -> torch.Tensor:
        """Loaded-layout storage offsets -> where a permuting post-load step moved those elements."""
        if target not in self.offset_maps or not offsets.numel():
            return offsets
        return self.offset_maps[target].live(offsets)

    def loaded_flat(self, target: str) -> torch.Tensor:
        """The target's flat storage in the loaded layout (undoing a permuting post-load step)."""
        flat = flat_storage(self.targets[target])
        return self.offset_maps[target].loaded(flat) if target in self.offset_maps else flat
