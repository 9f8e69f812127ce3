"""How each checkpoint tensor goes through staging on this rank, worked out once per ownership (the
other ranks' coverage) and kept: placements are fixed after startup, so a tensor's route (replayed,
batched or masked), its segments' landings and a batch's grouping by destination are the same every sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_delta.engine.batched import Known, Landing, Piece, on_device
from vllm_delta.engine.digests import Ownership
from vllm_delta.engine.placement import Segment, TensorPlacement, owned_by_tensor
from vllm_delta.engine.staging import Named, check_resolvable, flat_storage
from vllm_delta.engine.transforms import OffsetMap
from vllm_delta.wire.deltas import DeltaBatch

# A tensor's way through `stage`: replayed through its loader, batched, or masked alone.
FALLBACK, BATCH, MASKED = 0, 1, 2
# A destination group of a batch: (target, delta dtype, needs_base, decoded on the device).
GroupKey = tuple[str, torch.dtype, bool, bool]


@dataclass(frozen=True)
class Landed:
    """A tensor's element count, its segments' landings, and whether every target is served in the
    checkpoint's dtype (so no `check_resolvable`)."""

    numel: int
    landings: tuple[tuple[Segment, Landing], ...]
    same: bool


UNLANDED = Landed(0, (), True)


@dataclass(frozen=True)
class Route:
    kind: int  # FALLBACK, BATCH or MASKED
    landed: Landed  # a fallback's lands nowhere (`UNLANDED`): it is replayed through its loader


@dataclass(frozen=True)
class Plan:
    """A decoded batch's tensors grouped as the stager groups them, once for a run of tensors: per
    destination key its tensors in slot order and `Piece`s, each piece's param, and the
    `check_resolvable` calls its base-relative steps need."""

    dtypes: list[torch.dtype]
    whole: bool  # every tensor is batched (else the rest is empty: `stage` takes it a tensor at a time)
    odd: list[int]  # tensors served in another dtype on some segment (`stage` checks their pre_digest)
    keys: list[GroupKey]
    tensors: list[list[str]]
    pieces: list[list[Piece]]
    types: list[object]  # each group's key into the batch's `values`
    order: np.ndarray  # int64 [pieces]: each piece's param in the batch
    bounds: list[int]  # group g's pieces are order[bounds[g]:bounds[g + 1]]
    checks: list[tuple[str, torch.dtype, str, torch.dtype]]
    known: list[Known]  # per group: what locate works out of its pieces alone, once for every sync

    @classmethod
    def of(cls, item: DeltaBatch, routes: Mapping[str, Route], targets: Mapping[str, torch.Tensor]) -> Plan:
        groups: dict[GroupKey, tuple[list[str], list[Piece], list[int], object]] = {}
        checks, odd = [], []
        needs_base = item.needs_base
        if any(name not in routes or routes[name].kind != BATCH for name in item.names):
            return cls(list(item.dtypes), False, [], [], [], [], [], np.zeros(0, dtype=np.int64), [0], [], [])
        for i, (name, dtype, vtype) in enumerate(zip(item.names, item.dtypes, item.types)):
            landed = routes[name].landed
            if not landed.same:
                odd.append(i)
            for seg, landing in landed.landings:
                if needs_base and not landed.same:
                    checks.append((seg.target, targets[seg.target].dtype, name, dtype))
                key = (seg.target, dtype, needs_base, False)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = ([], [], [], vtype)
                tensors, pieces, params, _ = group
                if not tensors or tensors[-1] != name:
                    tensors.append(name)
                pieces.append(Piece(len(tensors) - 1, None, None, seg, landed.numel, landing))
                params.append(i)
        values = list(groups.values())
        return cls(
            list(item.dtypes),
            True,
            odd,
            list(groups),
            [g[0] for g in values],
            [g[1] for g in values],
            [g[3] for g in values],
            np.array([i for g in values for i in g[2]], dtype=np.int64),
            np.cumsum([0] + [len(g[2]) for g in values]).tolist(),
            checks,
            [Known() for _ in values],
        )

    def add(self, item: DeltaBatch, groups: dict, runs: dict, known: dict) -> None:
        """Put the batch's pieces and entries into the stager's groups, one gather per group; `known[key]`:
        the group's `Known` where this plan alone gives its pieces, else None."""
        for target, served, name, dtype in self.checks:
            check_resolvable(target, served, Named(name, dtype))
        sizes = np.array(item.sizes, dtype=np.int64)
        length = sizes[self.order]  # entries of each piece
        end = np.cumsum(length)
        total = int(end[-1]) if end.size else 0
        # Each piece's entries, in group order: its param's run of the batch's entries.
        index = torch.from_numpy(
            np.repeat((np.cumsum(sizes) - sizes)[self.order] - (end - length), length)
            + np.arange(total, dtype=np.int64)
        )
        at = np.concatenate(([0], end))[self.bounds].tolist()
        counts = length.tolist()
        b = self.bounds
        for g, key in enumerate(self.keys):
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
                known[key] = self.known[g]
            else:
                known[key] = None
            pieces, names = group
            if key not in runs:  # a group of per-tensor deltas so far: their entries as runs, in order
                runs[key] = [(p.positions, p.values, [p.positions.numel()]) for p in pieces]
            base = len(names)
            names.extend(self.tensors[g])
            pieces.extend(
                self.pieces[g]
                if not base
                else [Piece(base + p.slot, None, None, p.seg, p.numel, p.landing) for p in self.pieces[g]]
            )
            sub = index[at[g] : at[g + 1]]
            runs[key].append(
                (
                    item.positions.index_select(0, sub),
                    item.values[self.types[g]].index_select(0, sub),
                    counts[b[g] : b[g + 1]],
                )
            )


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
    _landed: dict[str, Landed] = field(default_factory=dict)
    _disjoint: dict[str, bool] = field(default_factory=dict)  # tensor -> its segments hold disjoint ids
    # Plans by (tensor names, needs_base): the last sync's, and this one's (a plan unused for a sync goes).
    _last_plans: dict[tuple, Plan] = field(default_factory=dict)
    _plans: dict[tuple, Plan] = field(default_factory=dict)
    _plans_for: dict[str, Route] | None = None  # the routes the plans were made from
    _decode_devices: dict[str, torch.device] | None = None
    _decode_for: Ownership | None = None
    _owned_ranges: dict[str, list[tuple[int, int]] | None] | None = None

    def _batchable(self, name: str) -> bool:
        """Every element of `name` held here is held once and by no lower rank: no per-element mask."""
        known = self._disjoint.get(name)
        if known is None:
            spans = sorted((s.src_offset, s.src_last) for s in self.placements[name].segments)
            known = self._disjoint[name] = all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
        return known and not self.ownership.lower.get(name)

    def _landings(self, name: str) -> Landed:
        got = self._landed.get(name)
        if got is None:
            placement = self.placements[name]
            numel = torch.Size(placement.shape).numel()
            same = all(
                self.targets[seg.target].dtype == self.checkpoint[name][1] for seg in placement.segments
            )
            got = self._landed[name] = Landed(
                numel, tuple((seg, Landing.of(seg, numel)) for seg in placement.segments), same
            )
        return got

    def routes(self) -> dict[str, Route]:
        """Each tensor's `Route`, made once per ownership."""
        if self._routes is None or self._routes_for is not self.ownership:
            self._routes = {
                name: Route(FALLBACK, UNLANDED)
                if placement.fallback_reason
                else Route(BATCH if self._batchable(name) else MASKED, self._landings(name))
                for name, placement in self.placements.items()
            }
            self._routes_for = self.ownership
        return self._routes

    def new_sync(self) -> None:
        """Plans this sync does not use again are dropped after it."""
        if self._plans_for is self.routes():
            self._last_plans, self._plans = self._plans, {}

    def plan(self, item: DeltaBatch) -> Plan | None:
        """How a decoded batch's tensors group by destination (None: some are not batched), kept for the
        next sync, which brings the same runs."""
        routes = self.routes()
        if self._plans_for is not routes:  # a new ownership re-routes: its plans go too
            self._plans_for, self._last_plans, self._plans = routes, {}, {}
        key = (tuple(item.names), item.needs_base)
        plan = self._plans[key] if key in self._plans else self._last_plans.pop(key, None)
        if plan is None or plan.dtypes != item.dtypes:
            plan = Plan.of(item, routes, self.targets)
        self._plans[key] = plan
        return plan if plan.whole else None

    def owned_ranges(self) -> dict[str, list[tuple[int, int]] | None]:
        """Each tensor's checkpoint ranges this rank decodes (`placement.owned_by_tensor`), once."""
        if self._owned_ranges is None:
            self._owned_ranges = owned_by_tensor(self.placements)
        return self._owned_ranges

    def decode_devices(self) -> dict[str, torch.device]:
        """Batchable tensors whose destinations are all dense on one accelerator: decoded there."""
        if self._decode_devices is None or self._decode_for is not self.ownership:
            devices = {}
            for name, route in self.routes().items():
                if route.kind != BATCH or not all(landing.dense for _, landing in route.landed.landings):
                    continue
                where = {self.targets[seg.target].device for seg, _ in route.landed.landings}
                if len(where) == 1 and on_device(device := next(iter(where))):
                    devices[name] = device
            self._decode_devices, self._decode_for = devices, self.ownership
        return self._decode_devices

    def permuted(self, target: str, offsets: torch.Tensor) -> torch.Tensor:
        """Loaded-layout storage offsets -> where a permuting post-load step moved those elements."""
        if target not in self.offset_maps or not offsets.numel():
            return offsets
        return self.offset_maps[target].live(offsets)

    def loaded_flat(self, target: str) -> torch.Tensor:
        """The target's flat storage in the loaded layout (undoing a permuting post-load step)."""
        flat = flat_storage(self.targets[target])
        return self.offset_maps[target].loaded(flat) if target in self.offset_maps else flat
