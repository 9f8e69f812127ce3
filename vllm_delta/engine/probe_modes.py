"""The probe's loader interception: run `load_weights` while performing no write into any storage
that existed before it started, and record what it would have written where.

Why a TorchDispatchMode: writes are found from the op schema's alias info (in-place ops, `out=`
arguments), not op names, so every way a loader writes is seen. One skeleton (`_Intercept`) blocks
and records; `ProbeMode` (one probe, fills and refusals kept for the careful pass) and `BatchMode`
(many meta probes in one call, any unprovable write rejects the batch) decide what a write means.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm_delta.engine.placement import Fill


@dataclass(frozen=True)
class Write:
    target: str  # the parameter written
    dst: torch.Tensor  # the destination view of its storage
    src: torch.Tensor  # what the loader copied there


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """Tensors the op writes, from its schema's alias info (in-place `self`, `out=` and the like)."""
    writes = _WRITES.get(func)
    if writes is None:  # the schema's written arguments, looked up once per op
        writes = _WRITES[func] = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
    out = []
    for i, name in writes:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def _tensors(args: tuple, kwargs: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (aten arguments nest at most one list deep)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


def _fresh_outputs(func: Any, result: Any) -> list[torch.Tensor]:
    """Outputs the op allocated (no alias info on the return): scratch the loader may write."""
    returns = func._schema.returns
    results = result if isinstance(result, (tuple, list)) and len(returns) > 1 else (result,)
    fresh = []
    for ret, value in zip(returns, results):
        if ret.alias_info is None or func is torch.ops.aten.lift_fresh.default:
            fresh.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return fresh


class _Intercept(TorchDispatchMode):
    """Perform no write into a storage that existed before the loader started (parameters or
    anything else) except a probe's; hand each blocked write to `_record`."""

    def __init__(self, storages: Mapping[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.scratch: set[int] = set()  # storages the loader allocated while probing

    def _saw(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Note the probes the op reads."""

    def _into_probe(self, cdata: int) -> bool:
        """Whether a write into this storage is a write into a probe (noted, not blocked)."""
        raise NotImplementedError

    def _record(self, func: Any, w: torch.Tensor, target: str | None, args: tuple) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._saw(args, kwargs)
        blocked = False
        for w in written(func, args, kwargs):
            cdata = w.untyped_storage()._cdata
            if self._into_probe(cdata):
                continue
            if w.numel() == 0 or cdata in self.scratch:
                continue  # writes nothing (e.g. vLLM's fill of an empty vocab pad), or the loader's own
            blocked = True
            self._record(func, w, self.storages.get(storage_key(w)), args)
        if blocked:  # not performed; hand back what the op would have returned
            out = written(func, args, kwargs)
            return out[0] if len(func._schema.returns) <= 1 else tuple(out)
        result = func(*args, **kwargs)
        self.scratch.update(t.untyped_storage()._cdata for t in _fresh_outputs(func, result))
        return result


class ProbeMode(_Intercept):
    """One probe: record `copy_`s into parameters and scalar fills, refuse every other such write."""

    def __init__(self, storages: Mapping[int, str], probe: torch.Tensor) -> None:
        super().__init__(storages)
        self.probe = probe.untyped_storage()._cdata
        self.writes: list[Write] = []
        self.fills: list[Fill] = []
        self.refused: list[str] = []
        self.read = False  # the loader touched the probe
        self.probe_written = False  # ... and wrote into it (its views no longer hold the ids)

    def is_probe(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata == self.probe

    def _saw(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        if not self.read:
            self.read = any(
                isinstance(t, torch.Tensor) and self.is_probe(t) for t in tree_leaves((args, kwargs))
            )

    def _into_probe(self, cdata: int) -> bool:
        if cdata == self.probe:
            self.probe_written = True
            return True
        return False

    def _record(self, func: Any, w: torch.Tensor, target: str | None, args: tuple) -> None:
        if target is None:
            self.refused.append(f"{func} writes a tensor that is neither a parameter nor the loader's own")
        elif func is torch.ops.aten.copy_.default:
            self.writes.append(Write(target, w, args[1]))
        elif (value := _fill_value(func, args)) is not None:
            self.fills.append(
                Fill(target, tuple(w.shape), w.storage_offset(), tuple(w.stride()), value, str(func))
            )
        else:
            self.refused.append(f"{func} writes parameter {target}")


class BatchMode(_Intercept):
    """`ProbeMode` for many meta probes fed to one `load_weights` call: a write is attributed to
    the checkpoint tensor whose probe it copies (by storage identity, not by loader order).

    Anything the fast pass would not prove - a write into a probe, a write that is not a `copy_` of a
    probe's view, a write outside the parameters - marks the batch `rejected` at `current` (the
    index of the tensor last handed to the loader), and the caller re-probes those tensors.
    """

    def __init__(
        self, storages: Mapping[int, str], probes: Mapping[int, int], dtypes: list[torch.dtype]
    ) -> None:
        super().__init__(storages)
        self.probes, self.dtypes = probes, dtypes
        self.writes: dict[int, list[Write]] = {}
        self.read: set[int] = set()
        self.current = 0
        self.rejected: int | None = None

    def reject(self) -> None:
        if self.rejected is None:
            self.rejected = self.current

    def _saw(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        for t in _tensors(args, kwargs):
            if (i := self.probes.get(t.untyped_storage()._cdata)) is not None:
                self.read.add(i)

    def _into_probe(self, cdata: int) -> bool:
        if cdata in self.probes:
            self.reject()
            return True
        return False

    def _record(self, func: Any, w: torch.Tensor, target: str | None, args: tuple) -> None:
        src = args[1] if func is torch.ops.aten.copy_.default else None
        owner = self.probes.get(src.untyped_storage()._cdata) if isinstance(src, torch.Tensor) else None
        if (
            target is None
            or owner is None
            or src.dtype != self.dtypes[owner]
            or src.is_neg()
            or src.is_conj()
        ):
            self.reject()
        else:
            self.writes.setdefault(owner, []).append(Write(target, w, src))


def _fill_value(func: Any, args: tuple) -> bool | int | float | None:
    """The scalar an op fills its destination with, or None when it is not a fill with a scalar
    (a fill with a tensor may carry checkpoint values: refused like any other write)."""
    if func is torch.ops.aten.zero_.default:
        return 0
    if func is torch.ops.aten.fill_.Scalar and type(args[1]) in (bool, int, float):
        return args[1]
    return None


def storage_key(t: torch.Tensor) -> int:
    """The key of a parameter's storage in the probe's `storages` map.

    Why two kinds: meta tensors (the full-shape harness) have no data pointer, so they are keyed by
    their storage object, negated so it never meets a real address.
    """
    storage = t.untyped_storage()
    return -storage._cdata if t.device.type == "meta" else storage.data_ptr()


def storages_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """`storages` for the probe from (name, parameter) pairs (the first name of a shared storage wins)."""
    out: dict[int, str] = {}
    for name, t in named:
        if t.numel() > 0:
            out.setdefault(storage_key(t), name)
    return out
