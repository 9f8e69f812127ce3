"""The one interception of loaders and post-load steps: what they read and write where. One
TorchDispatchMode reading each op schema's alias info (not op names), so every user sees writes alike."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@dataclass(frozen=True)
class Write:
    """A write the intercepted code asked for and was not performed."""

    func: Any  # the aten op
    target: str | None  # the parameter written; None: other storage that existed before the mode
    dst: torch.Tensor  # the destination view of its storage
    src: Any  # the op's second argument (what a `copy_` copies, a `fill_`'s value)
    at: int  # `Intercept.current` then: which of the caller's inputs the loader was at


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """Tensors the op writes, from its schema's alias info (in-place `self`, `out=` and the like)."""
    writes = _WRITES.get(func)
    if writes is None:  # looked up once per op
        writes = _WRITES[func] = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
    values = (args[i] if i < len(args) else kwargs.get(name) for i, name in writes)
    return [t for value in values for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage key in every map here (a meta tensor's storage object, negated)."""
    storage = t.untyped_storage()
    return -storage._cdata if t.device.type == "meta" else storage.data_ptr()


def storages_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """Parameter storages by key from (name, parameter) pairs (the first name of a shared storage wins)."""
    out: dict[int, str] = {}
    for name, t in named:
        if t.numel() > 0:
            out.setdefault(storage_key(t), name)
    return out


class Intercept(TorchDispatchMode):
    """Run code with its writes into `params` (storage key -> name) not performed: each is a `Write`
    (`record`), or done on the flat scratch copy `redirect` holds for its storage. Writes into `inputs`
    are noted in `input_writes`; `sealed` guards every other storage that existed before (target None)."""

    def __init__(
        self,
        params: Mapping[int, str] | None = None,
        *,
        inputs: Collection[int] = (),
        redirect: Mapping[int, torch.Tensor] | None = None,
        record: bool = True,
        sealed: bool = False,
    ) -> None:
        super().__init__()
        self.params, self.inputs, self.redirect = params or {}, inputs, redirect or {}
        self.record, self.sealed = record, sealed
        self.scratch: set[int] = set()  # storages the code allocated while sealed
        self.writes: list[Write] = []
        self.input_writes: list[int] = []  # `current` at each write into an input
        self.read: set[int] = set()  # the storage keys every op read, and wrote
        self.written: set[int] = set()
        self.current = 0  # the index of the input the loader was fed last

    @classmethod
    def sealed_on(cls, params: Mapping[int, str], inputs: list[tuple[str, torch.Tensor]]) -> Intercept:
        """Sealed around a loader fed `inputs` (their storage keys -> their index)."""
        return cls(params, inputs={storage_key(t): i for i, (_, t) in enumerate(inputs)}, sealed=True)

    def run(self, load_weights: LoadWeights, items: Iterable[tuple[str, torch.Tensor]]) -> Intercept:
        """`load_weights(items)` under this mode, `current` the index of the item fed last."""

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(items):
                self.current = i
                yield item

        with torch.no_grad(), self:
            load_weights(items if isinstance(items, list) and len(items) == 1 else feed())
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.read.update(storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        blocked, swap = False, {}
        for w in written(func, args, kwargs):
            key = storage_key(w)
            self.written.add(key)
            if key in self.inputs:
                self.input_writes.append(self.current)
            elif (flat := self.redirect.get(key)) is not None:
                if w.dtype != flat.dtype:
                    raise TypeError(f"loader writes a {flat.dtype} parameter as {w.dtype}")
                swap[id(w)] = torch.as_strided(flat, w.shape, w.stride(), w.storage_offset())
            elif w.numel() == 0 or key in self.scratch:
                continue  # writes nothing (e.g. vLLM's fill of an empty vocab pad), or the code's own
            elif (target := self.params.get(key)) is not None or self.sealed:
                blocked = True
                if self.record:
                    self.writes.append(
                        Write(func, target, w, args[1] if len(args) > 1 else None, self.current)
                    )
        if blocked:  # not performed; hand back what the op would have returned
            out = written(func, args, kwargs)
            return out[0] if len(func._schema.returns) <= 1 else tuple(out)
        if swap:
            args, kwargs = tree_map(
                lambda t: swap.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
        result = func(*args, **kwargs)
        if self.sealed:
            self.scratch.update(storage_key(t) for t in _fresh_outputs(func, result))
        return result


def _fresh_outputs(func: Any, result: Any) -> list[torch.Tensor]:
    """Outputs the op allocated (no alias info on the return): scratch the loader may write."""
    returns = func._schema.returns
    results = result if isinstance(result, (tuple, list)) and len(returns) > 1 else (result,)
    return [
        t
        for ret, value in zip(returns, results)
        if ret.alias_info is None or func is torch.ops.aten.lift_fresh.default
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor)
    ]
