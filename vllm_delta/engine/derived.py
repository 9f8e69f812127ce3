"""Post-load steps whose results a delta must keep exact, one `Unit` each: quant methods' (`transforms`),
attention layers' and the model's (`Discoverer`: what MLA derives from `kv_b_proj` is a "view", "rederive"
or "constant", its sources probed, else refused). Built on a stand-in in prepare (`prebuild`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine import stand_in
from vllm_delta.engine.intercept import Intercept, storage_key
from vllm_delta.engine.stand_in import Built, Held, NotStandIn, reach

DISCOVERY_ATTR = "_delta_derived"  # on the model: its `Discovery`
Step = Callable[[nn.Module], None]  # a unit's step, run on the module given (the unit or its stand-in)


@dataclass
class DerivedTensor:
    unit: str  # the module whose step derives it ("" the model)
    key: str  # relative to the unit: "param:W_UV", "impl.attr:_w_uk_packed", "kv_b_proj.param:weight"
    kind: str  # "view" | "rederive" | "constant"
    sources: list[str] = field(default_factory=list)  # checkpoint parameters it is derived from


@dataclass
class Unit:
    """A post-load step whose results a commit keeps exact, and how to run it again."""

    name: str
    module: nn.Module
    step: Step
    sources: set[str]  # checkpoint parameters (full names): a commit writing one re-runs the step
    # reach key -> what the step makes of it: "rederive" (copied in at commit), "view", "constant", or
    # "emptied" (a checkpoint parameter it empties, which keeps its bytes)
    derived: dict[str, str] = field(default_factory=dict)
    # own parameter -> its checkpoint-layout copy: deltas are written there and the step reads it
    canonical: dict[str, torch.Tensor] = field(default_factory=dict)
    kind: str = "rederive"  # "rerun": a quant method's step (`transforms`)
    on_stand_in: bool = True  # whether it is known to keep to its module (else re-run in the pause)

    def rederive(self) -> None:
        """Re-run the step in place from copies of the canonical tensors (a step may write into the
        parameter it gets: vLLM's fused MoE)."""
        rederive(self.module, self.step, inputs={n: c.clone() for n, c in self.canonical.items()})


@dataclass
class Discovery:
    tensors: list[DerivedTensor] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # "unit.key" or unit -> why


def location(t: torch.Tensor) -> tuple:
    """Where a tensor's bytes are: a rebound `.data` or a new object moves it."""
    return (storage_key(t) if t.numel() else 0, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tensors(held: Held) -> dict[str, torch.Tensor]:
    return {k: t for k, (_, _, _, t) in held.items()}


def rederive(unit: nn.Module, step: Step, inputs: Mapping[str, torch.Tensor] | None = None) -> None:
    """Run the step again (from `inputs`: param name -> data, where given), its results `copy_`-ed into
    the tensors the unit held before (same shape and dtype, or this raises) and every object put back:
    no `data_ptr()` moves (CUDA graphs, RFC #48312)."""
    held = reach(unit)
    data = {k: stand_in.data(t) for k, (_, _, _, t) in held.items()}
    with torch.no_grad():
        for n, t in (inputs or {}).items():
            unit._parameters[n].data = t
        step(unit)
        after = _tensors(reach(unit))
        for key, (owner, kind, name, old) in held.items():
            new = stand_in.data(after.get(key, old))
            target = data[key]
            emptied = kind == "param" and new.numel() == 0 and target.numel()  # a param we keep
            if location(new) != location(target) and not emptied:
                if new.shape != target.shape or new.dtype != target.dtype:
                    raise RuntimeError(
                        f"re-running the step changed {key} from {tuple(target.shape)} "
                        f"{target.dtype} to {tuple(new.shape)} {new.dtype}: it cannot be "
                        "re-derived in place"
                    )
                target.copy_(new)
            if after.get(key) is not old:
                stand_in.put_back(owner, kind, name, old)
            if isinstance(old, nn.Parameter) and old.data.data_ptr() != target.data_ptr():
                old.data = target  # the step rebound .data of a held Parameter: back to its own storage
        added = after.keys() - held.keys()
        if added:
            raise RuntimeError(f"re-running the step added {sorted(added)}")


def _other_values(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Values unlike `t`'s in every element (a probe fill)."""
    if t.dtype.is_floating_point:
        fill = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)
        return torch.where(fill == t, fill + 1, fill)
    return ~t if t.dtype == torch.bool else t + 1


class Discoverer:
    """Observes attention layers' and the model's steps as vLLM runs them and classifies what they derive."""

    def __init__(self, model: nn.Module, found: Discovery) -> None:
        self.model, self.found = model, found
        self.names = {n for n, _ in model.named_parameters()}
        self.params: dict[str, nn.Parameter] = {}  # checkpoint parameters, as the quant steps left them

    def observe(self, name: str, unit: nn.Module, step: Step) -> None:
        if not self.params:  # the quant methods' steps ran first; this one may replace some
            self.params = {n: p for n, p in self.model.named_parameters() if n in self.names}
        ckpt = {id(p): n for n, p in self.params.items()}
        before = reach(unit)
        signatures = {k: (id(t), location(stand_in.data(t))) for k, (_, _, _, t) in before.items()}
        access = Intercept()  # performs everything; notes the storages each op read and wrote
        with access:
            step(unit)
        after = _tensors(reach(unit))
        derived: list[str] = []
        kinds: dict[str, str] = {}  # checkpoint parameters the step emptied, then views
        try:
            for key, t in after.items():
                if signatures.get(key) == (id(t), location(stand_in.data(t))) and not (
                    t.numel() and storage_key(t) in access.written
                ):
                    continue
                owner, kind, attr, old = before.get(key, (None, "", "", None))
                if old is None or id(old) not in ckpt:
                    derived.append(key)
                elif not t.numel() and old.numel() and location(old.data) == signatures[key][1]:
                    stand_in.put_back(owner, kind, attr, old)  # AMX: the weight emptied, its copies derived
                    kinds[key] = "emptied"
                else:
                    raise RuntimeError(f"it changes checkpoint parameter {ckpt[id(old)]} ({key})")
            if derived:
                self._classify(name, unit, step, derived, kinds, access.read)
        except Exception as exc:
            self.found.refused[name or "<model>"] = (
                f"its post-load step derives tensors that cannot be re-derived in place "
                f"({type(exc).__name__}: {exc})"
            )

    def _classify(
        self, name: str, unit: nn.Module, step: Step, derived: list[str], kinds: dict, read: set
    ) -> None:
        now = _tensors(reach(unit))
        storages = {storage_key(p): n for n, p in self.params.items() if p.numel()}
        for key in derived:
            if now[key].numel() and storage_key(now[key]) in storages:
                self.found.tensors.append(DerivedTensor(name, key, "view", [storages[storage_key(now[key])]]))
                kinds[key] = "view"
        copies = [k for k in derived if k not in kinds]
        if not copies:
            return
        # Candidate sources: parameters the step read, and those a layer unit holds (not the model's: all).
        candidates = {n for s, n in storages.items() if s in read}
        if name:
            ckpt = {id(p): n for n, p in self.params.items()}
            candidates |= {ckpt[id(t)] for t in now.values() if id(t) in ckpt}
        reference = {k: now[k].detach().clone() for k in copies}
        rederive(unit, step)
        if not self._reproduces(name, unit, reference, "re-running it does not reproduce"):
            return
        sources: dict[str, list[str]] = {k: [] for k in copies}
        gen = torch.Generator().manual_seed(0)
        for n in sorted(candidates):
            p = self.params[n]
            saved = p.detach().clone()
            try:
                with torch.no_grad():
                    p.data.copy_(_other_values(saved, gen))
                rederive(unit, step)
                probed = _tensors(reach(unit))
                for k in copies:
                    if not stand_in.same_bits(probed[k], reference[k]):
                        sources[k].append(n)
            finally:
                with torch.no_grad():
                    p.data.copy_(saved)
            rederive(unit, step)
        if not self._reproduces(name, unit, reference, "re-running it after a probe does not restore"):
            return
        for k in copies:
            kinds[k] = "rederive" if sources[k] else "constant"
            self.found.tensors.append(DerivedTensor(name, k, kinds[k], sources[k]))
        used = {n for k in copies for n in sources[k]}
        if used:
            self.found.units.append(Unit(name, unit, step, used, kinds))

    def _reproduces(self, name: str, unit: nn.Module, reference: dict[str, torch.Tensor], what: str) -> bool:
        """Whether the unit holds `reference`'s bits again; each tensor that does not is refused."""
        now = _tensors(reach(unit))
        wrong = [k for k, want in reference.items() if not stand_in.same_bits(now[k], want)]
        for k in wrong:
            self.found.refused[f"{name}.{k}" if name else k] = (
                f"derived by the post-load step of {name or 'the model'}; {what} it bit for bit"
            )
        return not wrong


def discovery(model: nn.Module) -> Discovery:
    return getattr(model, DISCOVERY_ATTR, None) or Discovery()


def touched(model: nn.Module, written: Iterable[str]) -> list[Unit]:
    """The units a commit writing `written` re-runs: those it writes a source of."""
    names = set(written)
    return [unit for unit in discovery(model).units if unit.sources & names]


def prebuild(model: nn.Module, unit: Unit, written: Mapping[str, torch.Tensor]) -> Built:
    """In prepare: the unit's step on a stand-in holding the `written` sources (param name -> the tensor
    deltas go to, with the staged writes), canonical copies and scratch copies of what it derives: the new
    bits for the commit to copy in place and the handlers to swap in (`NotStandIn` where it cannot)."""
    if not unit.on_stand_in:
        raise NotStandIn("it is not known to keep to its own layer")
    stashed = {
        f"{u.name}.{n}" if u.name else n for u in discovery(model).units if u is not unit for n in u.canonical
    }
    moved = sorted(stashed.intersection(written))
    if moved:
        raise NotStandIn(f"its sources {moved} are re-laid by their own post-load step")
    held = reach(unit.module)
    live = {id(model.get_parameter(n)): n for n in unit.sources if n in written}
    prefix = f"{unit.name}." if unit.name else ""
    swap = {f"param:{n}": c.clone() for n, c in unit.canonical.items() if prefix + n not in written}
    for key, (_, _, _, t) in held.items():
        if id(t) in live:
            swap[key] = written[live.pop(id(t))]
        elif unit.derived.get(key, "emptied") != "emptied" and key not in swap:
            swap[key] = stand_in.data(t).clone()  # scratch for what it derives: nothing live is written
    if live:
        raise NotStandIn(f"it reads {sorted(live.values())} other than through its module")
    after, built, read = stand_in.run(unit.module, unit.step, swap)
    sources = [model.get_parameter(n) for n in unit.sources if n in written]
    if {storage_key(p) for p in sources if p.numel()} & read or after.keys() != held.keys():
        raise NotStandIn("it reads a live source or adds tensors")
    for key, (_, _, _, t) in after.items():
        new, old = stand_in.data(t), stand_in.data(held[key][3])
        kind = unit.derived.get(key)
        if kind == "rederive":
            if new.shape != old.shape or new.dtype != old.dtype:
                raise NotStandIn(f"it makes {key} {tuple(new.shape)} {new.dtype}, not {tuple(old.shape)}")
            built.copies.append((old, new))
        elif kind is None and key not in swap and location(new) != location(old):
            raise NotStandIn(f"it moves {key}")
    if any(isinstance(v, (torch.Tensor, nn.Module)) for _, _, v in built.swaps):
        raise NotStandIn("it swaps in a tensor or module")
    return built
