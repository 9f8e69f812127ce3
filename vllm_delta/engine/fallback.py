"""Tensors whose loader the probe cannot map, served exactly: a host shadow in checkpoint layout whose
loader, replayed sealed, must reproduce the live weights bit for bit at startup; in prepare the replays
of the old and new shadow give the writes (unlike vLLM's patches, checked, and staged before the pause)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from vllm_delta.engine.intercept import Intercept, LoadWeights, storage_key
from vllm_delta.engine.placement import grid
from vllm_delta.engine.probe import UnmappableLoader, copies_and_fills
from vllm_delta.engine.staging import Staging, Sums, chunk, flat_storage
from vllm_delta.wire import ParamDelta
from vllm_delta.wire.additive import partial_sum, tensor_sum, to_hex
from vllm_delta.wire.codecs import ulp_resolve_tensor
from vllm_delta.wire.errors import IncompatibleDeltaError, IntegrityError


@dataclass
class Write:
    """What a load of one tensor stores in one live target: storage offsets and values (target dtype)."""

    target: str
    offsets: torch.Tensor
    values: torch.Tensor


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so equality is bit equality (NaN == NaN, -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differs(live: Mapping[str, torch.Tensor], writes: list[Write]) -> str | None:
    """The first target whose live values differ from `writes` (bitwise), or None."""
    for w in writes:
        if not torch.equal(bits(flat_storage(live[w.target])[w.offsets]), bits(w.values)):
            return w.target
    return None


def same(a: list[Write], b: list[Write], values: bool = False) -> bool:
    """Whether two replays write the same elements (and, with `values`, the same bits)."""
    return len(a) == len(b) and all(
        x.target == y.target
        and torch.equal(x.offsets, y.offsets)
        and (not values or torch.equal(bits(x.values), bits(y.values)))
        for x, y in zip(a, b)
    )


@dataclass(eq=False)
class Shadows:
    """The shadows of this rank's unmapped tensors (`tensors`), and why the others' loaders are refused."""

    load_weights: LoadWeights
    storages: Callable[[], dict[int, str]]  # live parameter storages -> names, as now
    targets: dict[str, torch.Tensor]
    rank: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def replay(self, storages: Mapping[int, str], name: str, tensor: torch.Tensor) -> list[Write]:
        """The writes `load_weights([(name, tensor)])` would make into the live targets; performs none."""
        fed = [(name, tensor)]
        copies, _ = copies_and_fills(
            Intercept.sealed_on(storages, fed).run(self.load_weights, fed), fills=False
        )
        writes = []
        for w in copies:
            dst, target = w.dst, self.targets[w.target]
            if storage_key(dst) != storage_key(target):
                raise UnmappableLoader(
                    f"loader writes {w.target} beside the tensor its deltas are written to"
                )
            offsets = grid(dst.storage_offset(), dst.shape, dst.stride(), target.device).reshape(-1)
            values = w.src.to(target.device).broadcast_to(dst.shape).to(dst.dtype)  # what copy_ would store
            writes.append(Write(w.target, offsets, values.reshape(-1)))
        return writes

    def _check_servable(self, storages: Mapping[int, str], name: str, shadow: torch.Tensor) -> set[str]:
        """The targets the replay writes, or `UnmappableLoader` where it does not reproduce the weights."""
        first = self.replay(storages, name, shadow)
        if not same(first, self.replay(storages, name, shadow), values=True):
            raise UnmappableLoader("loader is not deterministic")
        for target in {w.target for w in first}:
            offsets = torch.cat([w.offsets for w in first if w.target == target])
            if offsets.unique().numel() != offsets.numel():
                raise UnmappableLoader(f"loader writes some elements of {target} more than once")
        if (target := differs(self.targets, first)) is not None:
            raise UnmappableLoader(
                f"replaying the loader on the checkpoint does not give the loaded {target} "
                "(a post-load step changed it, or the loader reads other state)"
            )
        return {w.target for w in first}

    def plan(self, unmapped: Mapping[str, str], read: Callable[[str], torch.Tensor] | None) -> set[str]:
        """Keep a shadow of every unmapped tensor (name -> why) whose loader replays exactly; refuse the
        rest. Returns the targets the replays reach."""
        storages, replayed = self.storages(), set()
        for name, why in unmapped.items():
            if read is None:
                self.refused[name] = "no checkpoint to replay its loader from"
                continue
            shadow = read(name)
            try:
                replayed |= self._check_servable(storages, name, shadow)
            except UnmappableLoader as exc:
                self.refused[name] = f"{why}; its loader cannot be replayed exactly: {exc}"
            except Exception as exc:  # e.g. a quant method's replace_parameter left a loader that now fails
                self.refused[name] = f"{why}; its loader fails on replay: {type(exc).__name__}: {exc}"
            else:
                self.tensors[name] = shadow
                self.targets[name + "#checkpoint"] = shadow  # the shadow is a target of its own
        return replayed

    def stage(
        self, delta: ParamDelta, staging: Staging, sums: Sums, want: tuple[bool, bool], anchor: bool
    ) -> None:
        """Stage a tensor by replaying its loader on its shadow, old and new: the elements the new replay
        changes (live must equal the old replay, unless an anchor overwrites). Rank 0 counts its digests."""
        name = delta.name
        if name in self.refused:
            raise IncompatibleDeltaError(
                f"engine refuses updates to this tensor: {self.refused[name]}", param=name
            )
        shadow = self.tensors[name]
        positions, values = delta.positions.to(shadow.device), delta.values.to(shadow.device)
        old = shadow.view(-1)[positions]
        new = ulp_resolve_tensor(old, values) if delta.needs_base else values.to(shadow.dtype)
        for lane, values in enumerate((old, new)):
            if want[lane] and self.rank == 0:
                sums.add_rows([name], lane, [True], partial_sum(positions, values).reshape(1, 2))
        storages = self.storages()
        before = self.replay(storages, name, shadow)
        after = self.replay(storages, name, shadow.reshape(-1).index_put((positions,), new).view_as(shadow))
        if not same(before, after):
            raise IncompatibleDeltaError("its loader writes other elements for the new values", param=name)
        if not anchor and (target := differs(self.targets, before)) is not None:
            raise IntegrityError(
                f"pre-apply: live {target} differs from its loader's replay of the checkpoint", param=name
            )
        for b, a in zip(before, after):
            base = flat_storage(self.targets[a.target])[a.offsets] if anchor else b.values
            moved = torch.nonzero(bits(a.values) != bits(base)).squeeze(1)
            staging.add(a.target, chunk(self.targets[a.target], a.offsets[moved], a.values[moved]))
        target = name + "#checkpoint"
        staging.add(target, chunk(self.targets[target], positions, new), counted=False)

    def partial(self, name: str) -> str | None:
        """A replayed tensor's share of its digest: rank 0 counts its shadow, and a rank whose live weights
        differ from its replay counts it once more (so the sum cannot match)."""
        shadow = self.tensors.get(name)
        if shadow is None:
            return None
        drift = differs(self.targets, self.replay(self.storages(), name, shadow))
        copies = int(self.rank == 0) + int(drift is not None)
        return to_hex(tensor_sum(shadow) * copies) if copies else None
