"""Phase 2 of an apply, in the pause: scatter the staged chunks, read them back, install what prepare built
of the touched post-load steps (`prebuild_touched`). A failure part-way is an engine fault naming the
tensors it may have left half-written."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from time import perf_counter

import torch
from torch import nn

from vllm_delta.engine import derived
from vllm_delta.engine.fallback import bits
from vllm_delta.engine.staging import Chunk, StagedUpdate, flat_storage, gather, host_values
from vllm_delta.engine.stand_in import NotStandIn, Prebuilt
from vllm_delta.kernels import scatter as scatter_kernel
from vllm_delta.wire.codecs import ulp_resolve_tensor

IN_PAUSE_ATTR = "_delta_in_pause"  # on the model: {module: why} whose post-load step the last commit re-ran
# Entries the compiled CPU commit writes, then reads back, at a time: each block is read back while the
# lines it wrote are in cache (a third less time at 2% on 1 GB).
CPU_BLOCK = 1 << 14


class ApplyFault(Exception):
    """The scatter failed part-way: the weights of `suspect` (live tensor names) may be partly written."""

    def __init__(self, message: str, *, failed_at: str | None, suspect: list[str]) -> None:
        super().__init__(message)
        self.failed_at, self.suspect = failed_at, suspect


def commit(model: nn.Module, targets: Mapping[str, torch.Tensor], staged: StagedUpdate) -> float:
    """Scatter the staged entries into the live weights, read every written offset back (a write that did
    not land is a fault, not a silent difference), install the post-load work; the seconds it took
    (with a device synchronize)."""
    start = perf_counter()
    times = staged.times
    written: list[str] = []
    checks: list[tuple[str, torch.Tensor]] = []
    target = None
    checking = 0.0
    try:
        for target, chunks in staged.writes.items():
            written.append(target)
            flat = flat_storage(targets[target])
            missed = None
            while chunks:
                part = chunks.popleft()
                parts = [part]
                if part.offsets.numel() > CPU_BLOCK and scatter_kernel.takes(flat, part.offsets, part.values):
                    split = zip(part.offsets.split(CPU_BLOCK), part.values.split(CPU_BLOCK))
                    parts = [Chunk(o, v, part.base) for o, v in split]
                for part in parts:
                    new = scatter(flat, part)
                    checked = perf_counter()
                    differ = read_back(flat, part.offsets, new)
                    missed = differ if missed is None else missed | differ
                    checking += perf_counter() - checked
            if missed is not None:
                checks.append((target, missed))
        target = None
        times.add("scatter", perf_counter() - start - checking)
        with times.phase("post_load"):
            refresh_touched(model, staged.writes, staged.prebuilt)
        with times.phase("scatter"):  # wait for the queued scatters, so a measured pause is the real one
            for device in {targets[t].device for t in written}:
                if device.type not in ("cpu", "meta"):
                    torch.accelerator.synchronize(device)
    except Exception as exc:
        raise ApplyFault(
            f"scatter failed{f' at {target}' if target else ''}: {type(exc).__name__}: {exc}",
            failed_at=target,
            suspect=written,
        ) from exc
    checked = perf_counter()
    # Targets whose read-back differed (meta holds no values to read).
    wrong = [t for (t, _), bad in zip(checks, host_values([f for _, f in checks])) if bad]
    times.add("read_back", perf_counter() - checked + checking)
    if wrong:
        raise ApplyFault(
            f"post-commit read-back: {len(wrong)} live tensor(s) do not hold the values written "
            f"({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''})",
            failed_at=wrong[0],
            suspect=wrong,
        )
    return perf_counter() - start


def prebuild_touched(
    model: nn.Module, targets: Mapping[str, torch.Tensor], writes: Mapping[str, Iterable[Chunk]]
) -> Prebuilt:
    """In prepare: `derived.prebuild` of every unit the staged `writes` touch, from copies of the written
    tensors with the writes (one unit's at a time); the rest is named `in_pause`."""

    def written(name: str) -> torch.Tensor:
        """A new copy of the target (its whole storage, so staged offsets index it) with its writes."""
        canon = targets[name]
        flat = flat_storage(canon).clone()
        for chunk in writes[name]:
            scatter(flat, chunk)
        return torch.as_strided(flat, canon.shape, canon.stride(), canon.storage_offset())

    out = Prebuilt()
    for unit in derived.touched(model, writes):
        try:
            out.built[unit.name, unit.kind] = derived.prebuild(
                model, unit, {n: written(n) for n in unit.sources if writes.get(n)}
            )
        except NotStandIn as exc:
            out.in_pause[unit.name or "<model>"] = f"its post-load step cannot run on a stand-in: {exc}"
    return out


def refresh_touched(model: nn.Module, writes: Iterable[str], prebuilt: Prebuilt) -> None:
    """At commit: copy in what prepare built of each touched unit; re-run the others' steps in place."""
    for unit in derived.touched(model, writes):
        built = prebuilt.built.get((unit.name, unit.kind))
        if built is not None:
            built.install()
        else:
            unit.rederive()
    setattr(model, IN_PAUSE_ATTR, dict(prebuilt.in_pause))


def scatter(flat: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """Write one staged chunk into a flat storage view (resolving ULP steps there): the values written
    (the compiled loop on the CPU where it applies; this torch path is its reference)."""
    if scatter_kernel.takes(flat, chunk.offsets, chunk.values):
        new = scatter_kernel.scatter(flat, chunk.offsets, chunk.values, chunk.base)
        if new is not None:
            return new
    offsets = chunk.offsets.to(flat.device, non_blocking=True).to(torch.int64)
    values = chunk.values.to(flat.device, non_blocking=True)
    if chunk.base is not None:
        values = ulp_resolve_tensor(gather(flat, offsets).to(chunk.base), values)
    values = values.to(flat.dtype)
    if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no fp8 index_copy_ on the CPU: copy the bits
        bits(flat).index_copy_(0, offsets, bits(values))
    else:
        flat.index_copy_(0, offsets, values)
    return values


def read_back(flat: torch.Tensor, offsets: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A bool tensor on flat's device: some live flat[offsets] differ bitwise from `new` (read after)."""
    if scatter_kernel.takes(flat, offsets, new):
        return scatter_kernel.missed(flat, offsets, new)
    return (bits(gather(flat, offsets.to(flat.device))) != bits(new)).any()
