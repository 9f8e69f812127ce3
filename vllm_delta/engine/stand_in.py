"""A post-load step run in prepare on a stand-in of a serving module (its own dicts, the live tensors but
those swapped in), installed at commit by copies and attribute swaps only: on the serving module it would
change what it serves before the commit. A write into live storage gives it up (`NotStandIn`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine.intercept import Intercept, storage_key

Held = dict[str, tuple[object, str, str, torch.Tensor]]  # key -> (owner, kind, attribute, tensor)
_OWN_STATE = ("_parameters", "_buffers", "_modules")
_UNSET = object()


class NotStandIn(Exception):
    """Why a step cannot run on a stand-in (it is re-run in the pause instead)."""


@dataclass
class Built:
    """What a step made on a stand-in, for the commit: copies into live tensors, then attribute swaps."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live tensor, new bits)
    swaps: list[tuple[object, str, object]] = field(default_factory=list)  # (live object, attribute, value)

    def install(self) -> None:
        """Copy each new value into the live tensor's storage (its data_ptr stays), then swap attributes."""
        with torch.no_grad():
            for live, new in self.copies:
                live.copy_(new)
        for owner, attr, value in self.swaps:
            object.__setattr__(owner, attr, value)


@dataclass
class Prebuilt:
    """A prepare's post-load work per unit (name, kind) and why the rest is re-run in the pause."""

    built: dict[tuple[str, str], Built] = field(default_factory=dict)
    in_pause: dict[str, str] = field(default_factory=dict)


def plain(obj: object) -> bool:
    """An object whose tensor attributes a module's step may set: its attention impl, quant method."""
    return (
        hasattr(obj, "__dict__")
        and not isinstance(obj, (nn.Module, torch.Tensor, type, dict, list, tuple))
        and not callable(obj)
    )


def held_tensors(module: nn.Module) -> dict[str, tuple[str, str, torch.Tensor]]:
    """Every tensor the module holds itself, keyed "param:n", "buffer:n", "attr:n": (kind, n, tensor)."""
    out = {f"param:{n}": ("param", n, p) for n, p in module.named_parameters(recurse=False)}
    out.update({f"buffer:{n}": ("buffer", n, b) for n, b in module.named_buffers(recurse=False)})
    out.update({f"attr:{n}": ("attr", n, v) for n, v in vars(module).items() if isinstance(v, torch.Tensor)})
    return out


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
    )


def reach(unit: nn.Module) -> Held:
    """Every tensor the unit, its submodules and their plain attribute objects hold, by relative key."""
    out: Held = {}
    for sub, m in unit.named_modules():
        pre = f"{sub}." if sub else ""
        out.update({pre + key: (m, kind, n, t) for key, (kind, n, t) in held_tensors(m).items()})
        for attr, obj in vars(m).items():
            if plain(obj):
                out.update(
                    {
                        f"{pre}{attr}.attr:{a}": (obj, "attr", a, t)
                        for a, t in vars(obj).items()
                        if isinstance(t, torch.Tensor)
                    }
                )
    return out


def put_back(owner: object, kind: str, name: str, obj: torch.Tensor | None) -> None:
    if kind == "param":
        owner._parameters[name] = obj  # type: ignore[attr-defined]
    elif kind == "buffer":
        owner._buffers[name] = obj  # type: ignore[attr-defined]
    else:
        object.__setattr__(owner, name, obj)


def data(t: torch.Tensor) -> torch.Tensor:
    return t.data if isinstance(t, nn.Parameter) else t


def run(
    unit: nn.Module, step: Callable[[nn.Module], None], swap: Mapping[str, torch.Tensor]
) -> tuple[Held, Built, set[int]]:
    """Run `step` on a stand-in of `unit` holding `swap`'s tensors at those `reach` keys: (its tensors after,
    the attribute swaps it asks of the live tree, the storages it read)."""
    copies: dict[int, object] = {}
    root = _copy(unit, copies)
    held = reach(root)  # type: ignore[arg-type]
    for key, t in swap.items():
        owner, kind, name, old = held[key]
        put_back(owner, kind, name, nn.Parameter(t, requires_grad=False) if kind == "param" else t)
    live = {i: (obj, _state(obj)) for i, obj in _objects(unit)}
    access = Intercept(inputs={storage_key(t) for t in swap.values() if t.numel()}, sealed=True)
    try:
        with torch.no_grad(), access:
            step(root)  # type: ignore[arg-type]
    finally:
        changed = sorted({a for obj, state in live.values() for a in _put_state(obj, state)})
    if changed:
        raise NotStandIn(f"it sets {changed} of the serving module's objects")
    if access.writes:
        raise NotStandIn(f"it writes {len(access.writes)} tensor(s) the engine serves from")
    built = Built()
    for i, (obj, state) in live.items():
        if i not in copies:
            continue
        copy = _state(copies[i])
        gone = state.keys() - copy.keys()
        if gone:
            raise NotStandIn(f"it deletes {sorted(gone)}")
        for attr, value in copy.items():
            old = state.get(attr, _UNSET)
            if ":" in attr or attr in _OWN_STATE or isinstance(value, torch.Tensor) or value is old:
                continue
            if copies.get(id(old)) is not value:  # not the stand-in's copy of the same object
                built.swaps.append((obj, attr, value))
    return reach(root), built, access.read  # type: ignore[arg-type]


def _copy(obj: object, copies: dict[int, object]) -> object:
    """`obj` with its own dicts (a module's, its submodules', its plain objects'); tensors shared."""
    if id(obj) in copies:
        return copies[id(obj)]
    try:
        new = object.__new__(type(obj))
    except TypeError:  # a tuple subclass, say: shared, and any attribute the step sets on it is caught
        return obj
    copies[id(obj)] = new
    new.__dict__.update(vars(obj))
    if isinstance(obj, nn.Module):
        new._parameters, new._buffers = dict(obj._parameters), dict(obj._buffers)  # type: ignore[attr-defined]
        new._modules = {n: m if m is None else _copy(m, copies) for n, m in obj._modules.items()}  # type: ignore[attr-defined]
        for attr, value in vars(obj).items():
            if plain(value):
                new.__dict__[attr] = _copy(value, copies)
    return new


def _objects(unit: nn.Module) -> Iterator[tuple[int, object]]:
    """The live tree's modules, their plain attribute objects and theirs (a quant method's kernel), by id."""
    for m in unit.modules():
        yield id(m), m
        for v in vars(m).values():
            if plain(v):
                yield id(v), v
                yield from ((id(w), w) for w in vars(v).values() if plain(w))


def _state(obj: object) -> dict[str, object]:
    """An object's attributes, and a module's parameters, buffers and submodules, by identity."""
    state = dict(vars(obj))
    if isinstance(obj, nn.Module):
        state.update({f"{k}:{n}": v for k in _OWN_STATE for n, v in getattr(obj, k).items()})
    return state


def _put_state(obj: object, state: dict[str, object]) -> list[str]:
    """Put `obj`'s attributes back as `state` holds them; returns those that had changed."""
    now = _state(obj)
    changed = [k for k in state.keys() | now.keys() if state.get(k, _UNSET) is not now.get(k, _UNSET)]
    if changed:
        vars(obj).clear()
        vars(obj).update({k: v for k, v in state.items() if ":" not in k})
        if isinstance(obj, nn.Module):
            for k in _OWN_STATE:
                getattr(obj, k).clear()
                getattr(obj, k).update(
                    {n.split(":", 1)[1]: v for n, v in state.items() if n.startswith(k + ":")}
                )
    return changed
