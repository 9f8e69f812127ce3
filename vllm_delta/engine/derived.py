"""Derived tensors: what attention layers' and the model's own post-load steps make from weights.

Why: MLA derives `W_UV` / `W_UK_T` from `kv_b_proj` in such a step (AMX keeps VNNI-packed copies and
empties `kv_b_proj.weight`); a delta to the source would leave a copy stale while every digest passes.
Each step (a "unit") is observed as vLLM runs it (`observe_units`); every tensor it binds or writes
that is not a checkpoint parameter is a "view" (shares a parameter's storage), "rederive" or
"constant" (re-running the step reproduces it bit for bit, also after its sources are changed and
restored: `prebuild` on a stand-in in prepare, else `rederive` in place at commit), or refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_delta.engine import stand_in
from vllm_delta.engine.intercept import Intercept, storage_key
from vllm_delta.engine.stand_in import Held, NotStandIn, reach

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
    """A post-load step that derives tensors, and how to run it again."""

    name: str
    module: nn.Module
    step: Step
    sources: set[str]  # re-derive when a commit writes any of these
    derived: dict[str, str] = field(default_factory=dict)  # key -> kind of each tensor it derives


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


def rederive(
    unit: nn.Module, step: Step, keep: Held | None = None, inputs: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Run the step again (from `inputs`: param name -> data, where given), its results `copy_`-ed into
    the tensors the unit held before (same shape and dtype, or this raises) and every object put back:
    no `data_ptr()` moves (CUDA graphs, RFC #48312)."""
    held = keep if keep is not None else reach(unit)
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
    if t.dtype == torch.bool:
        return ~t
    return t + 1


class _Discoverer:
    """Observes units' steps as vLLM runs them and classifies what they derive."""

    def __init__(self, model: nn.Module, checkpoint_names: set[str]) -> None:
        self.model, self.checkpoint_names = model, checkpoint_names
        self.found = Discovery()
        self._params: dict[str, nn.Parameter] | None = None  # checkpoint parameters, after the quant steps

    def params(self) -> dict[str, nn.Parameter]:
        """Checkpoint parameters by name, as the quant methods' steps (which run first) left them."""
        if self._params is None:
            self._params = {n: p for n, p in self.model.named_parameters() if n in self.checkpoint_names}
        return self._params

    def checkpoint(self) -> dict[int, str]:
        return {id(p): n for n, p in self.params().items()}

    def observe(self, name: str, unit: nn.Module, step: Step) -> None:
        self.params()  # the checkpoint parameters as they were before this step (it may replace some)
        before = reach(unit)
        signatures = {k: (id(t), location(stand_in.data(t))) for k, (_, _, _, t) in before.items()}
        access = Intercept()  # performs everything; notes the storages each op read and wrote
        with access:
            step(unit)
        after = _tensors(reach(unit))
        outputs = [
            k
            for k, t in after.items()
            if signatures.get(k) != (id(t), location(stand_in.data(t)))
            or (t.numel() and storage_key(t) in access.written)
        ]
        try:
            derived = self._keep_checkpoint_params(before, after, outputs, signatures)
            if derived:
                self._classify(name, unit, step, derived, access.read)
        except _Refused:
            pass
        except Exception as exc:
            self.found.refused[name or "<model>"] = (
                f"its post-load step derives tensors that cannot be re-derived in place "
                f"({type(exc).__name__}: {exc})"
            )

    def _keep_checkpoint_params(
        self, before: Held, after: dict[str, torch.Tensor], outputs: list[str], signatures: dict[str, tuple]
    ) -> list[str]:
        """Outputs that are not checkpoint parameters; a checkpoint parameter the step emptied gets its
        loaded bytes back, any other change refuses."""
        ckpt, derived = self.checkpoint(), []
        for key in outputs:
            owner, kind, name, old = before.get(key, (None, "", "", None))
            if old is None or id(old) not in ckpt:
                derived.append(key)
                continue
            emptied = after[key].numel() == 0 and old.numel()
            if emptied and location(stand_in.data(old)) == signatures[key][1]:
                stand_in.put_back(owner, kind, name, old)  # AMX: the weight emptied, its copies derived
                continue
            raise RuntimeError(f"it changes checkpoint parameter {ckpt[id(old)]} ({key})")
        return derived

    def _classify(self, name: str, unit: nn.Module, step: Step, derived: list[str], read: set[int]) -> None:
        ckpt, params = self.checkpoint(), self.params()
        keep = reach(unit)
        now = _tensors(keep)
        storages = {storage_key(p): n for n, p in params.items() if p.numel()}
        copies = []
        for key in derived:
            t = now[key]
            if t.numel() and storage_key(t) in storages:
                self.found.tensors.append(DerivedTensor(name, key, "view", [storages[storage_key(t)]]))
            else:
                copies.append(key)
        if not copies:
            return
        # Candidate sources: parameters the step read, and those a layer unit holds (not the model's: all).
        candidates = {n for s, n in storages.items() if s in read}
        if name:
            candidates |= {ckpt[id(t)] for t in now.values() if id(t) in ckpt}
        reference = {k: now[k].detach().clone() for k in copies}
        rederive(unit, step, keep)
        self._expect(name, unit, reference, "re-running it does not reproduce")
        sources: dict[str, list[str]] = {k: [] for k in copies}
        gen = torch.Generator().manual_seed(0)
        for n in sorted(candidates):
            p = params[n]
            saved = p.detach().clone()
            try:
                with torch.no_grad():
                    p.data.copy_(_other_values(saved, gen))
                rederive(unit, step, keep)
                probed = _tensors(reach(unit))
                for k in copies:
                    if not stand_in.same_bits(probed[k], reference[k]):
                        sources[k].append(n)
            finally:
                with torch.no_grad():
                    p.data.copy_(saved)
            rederive(unit, step, keep)
        self._expect(name, unit, reference, "re-running it after a probe does not restore")
        for k in copies:
            self.found.tensors.append(
                DerivedTensor(name, k, "rederive" if sources[k] else "constant", sources[k])
            )
        used = {n for k in copies for n in sources[k]}
        if used:
            kinds = {t.key: t.kind for t in self.found.tensors if t.unit == name}
            self.found.units.append(Unit(name, unit, step, used, kinds))

    def _expect(self, name: str, unit: nn.Module, reference: dict[str, torch.Tensor], what: str) -> None:
        now = _tensors(reach(unit))
        wrong = [k for k, want in reference.items() if not stand_in.same_bits(now[k], want)]
        for k in wrong:
            self.found.refused[f"{name}.{k}" if name else k] = (
                f"derived by the post-load step of {name or 'the model'}; {what} it bit for bit"
            )
        if wrong:
            raise _Refused()


class _Refused(Exception):
    """Raised after recording refusals, to stop classifying the unit."""


def observe_units(model: nn.Module) -> Iterator[tuple[nn.Module, Callable[..., None]]]:
    """Each attention layer and the model itself, with its post-load step observed (`_Discoverer`); the
    discovery lands on the model once the caller has run them all (`discovery`)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    found = _Discoverer(model, {n for n, _ in model.named_parameters()})
    setattr(model, DISCOVERY_ATTR, found.found)
    units = [(n, m) for n, m in model.named_modules() if is_deferred_attention_layer(m)]
    for name, module in units + ([("", model)] if hasattr(model, "process_weights_after_loading") else []):
        real = type(module).process_weights_after_loading

        def observed(*args, name=name, module=module, real=real, **kwargs) -> None:
            found.observe(name, module, lambda m: real(m, *args, **kwargs))

        yield module, observed


def discovery(model: nn.Module) -> Discovery:
    return getattr(model, DISCOVERY_ATTR, None) or Discovery()


def refused(model: nn.Module) -> dict[str, str]:
    """{module.tensor (or module): why} for derived tensors that cannot be kept exact: updates are refused."""
    return dict(discovery(model).refused)


def touched(model: nn.Module, written: Iterable[str]) -> list[Unit]:
    """The units a commit writing `written` re-derives: those it writes a source of."""
    names = set(written)
    return [unit for unit in discovery(model).units if unit.sources & names]


def prebuild(model: nn.Module, unit: Unit, written: Mapping[str, torch.Tensor]) -> stand_in.Built:
    """In prepare: the unit's step on a stand-in holding the `written` sources and scratch copies of what
    it derives: the new bits for the commit to copy in place (`NotStandIn` where it cannot)."""
    held = reach(unit.module)
    live = {id(model.get_parameter(n)): n for n in unit.sources if n in written}
    swap: dict[str, torch.Tensor] = {}
    for key, (_, _, _, t) in held.items():
        if id(t) in live:
            swap[key] = written[live.pop(id(t))]
        elif key in unit.derived:
            swap[key] = stand_in.data(t).clone()
    if live:
        raise NotStandIn(f"it reads {sorted(live.values())} other than through its module")
    after, built, read = stand_in.run(unit.module, unit.step, swap)
    stale = {storage_key(model.get_parameter(n)) for n in unit.sources if n in written} & read
    if stale or after.keys() != held.keys():
        raise NotStandIn("it reads a live source or adds tensors")
    for key, kind in unit.derived.items():
        new, old = stand_in.data(after[key][3]), stand_in.data(held[key][3])
        if kind == "rederive":
            if new.shape != old.shape or new.dtype != old.dtype:
                raise NotStandIn(f"it makes {key} {tuple(new.shape)} {new.dtype}, not {tuple(old.shape)}")
            built.copies.append((old, new))
    return built
