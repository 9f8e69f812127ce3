"""`register(optimizer, model_chunks, sender, bridge=...)`: sync the engines after each real optimizer step.
Why a wrapper of `MegatronOptimizer.step`: megatron-core has no post-step hook, and the inner optimizer's
fire before the fp32 -> bf16 copy. A skipped step fires nothing; `overlap_param_gather`'s all-gather is
finished first (as Megatron-LM's `force_param_sync`); the publish overlaps the next step."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from megatron_hook.hf_map import Parallel, chunk_segments, local_tensors
from vllm_delta.diff import changed_positions
from vllm_delta.sender.delta_sender import checkpoint_seed
from vllm_delta.sender.fp8_quant import BlockFp8Quantizer, Fp8ConfigError
from vllm_delta.sender.shards import Segments

logger = logging.getLogger(__name__)


class RebindError(RuntimeError):
    """A weight was rebound after `register()` in a way its segment views cannot follow."""


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


@dataclass
class _Weight:
    name: str  # the Megatron name, for messages
    module: torch.nn.Module
    attr: str
    ptr: int
    layout: tuple
    views: list[tuple[int, int]] = field(default_factory=list)  # (segment index, element offset from ptr)


class Bindings:
    """The weights behind `segments` (views of `chunks`' local tensors), checked every sync by `data_ptr`:
    a trainer that rebinds `param.data` (offload, re-wrapping) would leave a view on a dead copy and the
    served weights frozen. Views follow a weight whose layout held; anything else raises, naming it."""

    def __init__(self, chunks: Sequence[torch.nn.Module], segments: Sequence[Segments]) -> None:
        self.weights: list[_Weight] = []
        for i, gpt in enumerate(chunks):
            for name, t in local_tensors(gpt).items():
                mod, _, attr = name.rpartition(".")
                label = name if len(chunks) == 1 else f"chunk {i}: {name}"
                self.weights.append(_Weight(label, gpt.get_submodule(mod), attr, t.data_ptr(), _layout(t)))
        by_ptr = sorted(range(len(self.weights)), key=lambda k: self.weights[k].ptr)
        starts = [self.weights[k].ptr for k in by_ptr]
        for si, s in enumerate(segments):
            w = self._owner(s, by_ptr, starts)
            w.views.append((si, (s.tensor.data_ptr() - w.ptr) // s.tensor.element_size()))
        self.weights = [w for w in self.weights if w.views]

    def _owner(self, s: Segments, by_ptr: list[int], starts: list[int]) -> _Weight:
        """The weight whose bytes hold all of `s.tensor` (a segment over a copy has none: refused)."""
        t = s.tensor
        first = t.data_ptr()
        last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
        k = bisect.bisect_right(starts, first) - 1
        if k >= 0:
            w = self.weights[by_ptr[k]]
            shape, _, dtype, _ = w.layout
            end = w.ptr + torch.Size(shape).numel() * dtype.itemsize
            if last < end and t.dtype == dtype and t.device == w.layout[3]:
                return w
        raise RebindError(
            f"{s.name}: its segment is not a view of any model weight, so it would not see training change it"
        )

    def refresh(self, segments: list[Segments]) -> list[str]:
        """Re-point (in place) the views of weights rebound since the last call; their names. `RebindError`
        for one whose layout changed."""
        moved = []
        for w in self.weights:
            t = getattr(w.module, w.attr)
            if t.data_ptr() == w.ptr and _layout(t) == w.layout:
                continue
            if _layout(t) != w.layout:
                shape, stride, dtype, device = w.layout
                raise RebindError(
                    f"{w.name} was rebound after register(): it was {list(shape)} {dtype} on {device} with "
                    f"strides {stride}, now {list(t.shape)} {t.dtype} on {t.device} with strides "
                    f"{t.stride()}; "
                    "the hook cannot follow it (register again after changing the model's layout)"
                )
            for si, off in w.views:
                old = segments[si].tensor
                view = t.detach().as_strided(old.shape, old.stride(), t.storage_offset() + off)
                segments[si] = segments[si].with_tensor(view)
            w.ptr = t.data_ptr()
            moved.append(w.name)
        return moved


@dataclass
class SeedReport:
    """Elements where the trainer's weights differ from the served checkpoint at registration."""

    mismatches: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> flat positions (this rank)
    total: int = 0  # over every sender rank

    @property
    def ok(self) -> bool:
        return self.total == 0


class SeedMismatchError(RuntimeError):
    """The trainer's weights differ from the served checkpoint: every sync would ship wrong values."""


class HookHandle:
    """The registered hook; `remove()` puts the optimizer's own `step` back."""

    def __init__(
        self,
        optimizer,
        chunks: Sequence[torch.nn.Module],
        sender,
        segments: list[Segments],
        every: int,
        on_sync: Callable[[dict[str, float]], None] | None,
    ) -> None:
        self.optimizer, self.chunks, self.sender, self.segments = optimizer, list(chunks), sender, segments
        self.bindings = Bindings([_unwrap(c) for c in self.chunks], segments)
        self.every, self.on_sync = every, on_sync
        self.steps = self.skipped = self.syncs = 0  # steps that updated weights, steps skipped, syncs
        self.seed_report = SeedReport()
        self._inflight = None  # the last publish's future
        self.last_capture = None  # what the last sync shipped (staged entries), for checks
        self._own = vars(optimizer).get("step")  # an instance attribute of its own, put back by remove()
        self._step = optimizer.step
        optimizer.step = self._wrapped

    def _wrapped(self, *args, **kwargs):
        out = self._step(*args, **kwargs)
        if not (bool(out[0]) if isinstance(out, tuple) else bool(out)):
            self.skipped += 1
        else:
            self.steps += 1
            if self.steps % self.every == 0:
                self.fire()
        return out

    def fire(self) -> None:
        """Capture now (the weights may change once this returns) and publish in the background."""
        for chunk in self.chunks:
            cfg = getattr(chunk, "ddp_config", None)
            if cfg is not None and cfg.use_distributed_optimizer and cfg.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)
        if self._inflight is not None:
            # The publish thread's collectives and the rebind check's agreement on one group from two
            # threads could pair differently on different ranks and hang; capture() would wait anyway.
            futures.wait([self._inflight])
        self._follow_rebinds()
        self.last_capture = self.sender.capture(self.segments)
        if self._inflight is not None and self.on_sync is not None:  # done: waited for above
            self.on_sync(self._inflight.result())
        self._inflight = self.sender.publish()
        self.syncs += 1

    def _follow_rebinds(self) -> None:
        """Re-point the segments of weights the trainer rebound; every rank raises if one rank can't."""
        error = None
        try:
            if moved := self.bindings.refresh(self.segments):
                logger.warning("megatron_hook: re-derived the views of rebound weights %s", moved[:5])
        except RebindError as e:
            error = e
        if self.sender.ranks.any(error is not None):
            raise error or RebindError("a weight was rebound on another rank of the sender's group")

    def flush(self) -> dict[str, float]:
        """Wait for the publish in flight; its metrics (empty if none)."""
        metrics = self.sender.wait()
        if self._inflight is not None and self.on_sync is not None:
            self.on_sync(metrics)
        self._inflight = None
        return metrics

    def remove(self) -> None:
        """Stop syncing: wait for the last publish and restore the optimizer's `step`."""
        self.flush()
        if self._own is not None:
            self.optimizer.step = self._own
        else:
            del self.optimizer.step


def register(
    optimizer,
    model_chunks: Sequence[torch.nn.Module],
    sender,
    *,
    bridge,
    checkpoint: str | Path | None = None,
    seed_from_trainer: bool = False,
    seed_mismatch: Literal["raise", "warn"] = "raise",
    every: int = 1,
    on_sync: Callable[[dict[str, float]], None] | None = None,
) -> HookHandle:
    """Sync `sender`'s engines after every `every`-th optimizer step that updated the weights; every rank
    of the sender's group calls this. `model_chunks`: the DDP-wrapped chunks given to the optimizer;
    `bridge`: the model's mbridge bridge (its conversion code gives the HF map). `checkpoint` (the HF
    directory the engines loaded) seeds the snapshot from its bytes and finds every element where the
    trainer's weights differ (`handle.seed_report`): a wrong map or checkpoint raises `SeedMismatchError`
    at step 0 (`seed_mismatch="warn"` logs it). Without one nothing is checked, which takes an explicit
    `seed_from_trainer=True`. A block-fp8 shard that cuts a block is refused on every rank, naming what
    this rank holds: gathering would put a TP collective on the capture path."""
    if every < 1:
        raise ValueError("every must be >= 1")
    if seed_mismatch not in ("raise", "warn"):
        raise ValueError(f"seed_mismatch must be 'raise' or 'warn', not {seed_mismatch!r}")
    if (checkpoint is None) != seed_from_trainer:
        raise ValueError(
            "register() needs checkpoint= (the HF directory the engines loaded: the trainer's "
            "weights are checked against it at step 0) or, to seed from the trainer's weights "
            "with nothing checked, seed_from_trainer=True; not both"
        )
    segments = [s for chunk in model_chunks for s in chunk_segments(bridge, _unwrap(chunk))]
    report, fp8 = SeedReport(), None
    if checkpoint is None:
        seeded = [s.with_tensor(s.tensor.detach().reshape(-1).clone()) for s in segments]
    else:
        error = None
        try:  # a refusal on one rank ends register() on every rank, before the sender's collectives
            seeded, fp8, report = _seed_values(segments, Path(checkpoint))
        except (Fp8ConfigError, TypeError, KeyError) as e:
            error = e
        if sender.ranks.any(error is not None):
            raise error or RuntimeError("register() was refused on another rank of the sender's group")
        report.total = sender.ranks.all_sum(sum(p.numel() for p in report.mismatches.values()))
        if not report.ok:
            mine = {n: p[:5].tolist() for n, p in list(report.mismatches.items())[:5]} or "none"
            msg = (
                f"{report.total} elements of the trainer's weights differ from the served checkpoint "
                f"{checkpoint} (HF name: first flat positions, this rank: {mine})"
            )
            if seed_mismatch == "raise":
                raise SeedMismatchError(msg + "; pass seed_mismatch='warn' to sync anyway")
            logger.error("megatron_hook: %s", msg)
    sender.seed(seeded)
    sender.fp8 = fp8  # each capture quantizes this rank's blocks (None: nothing served in fp8)
    handle = HookHandle(optimizer, model_chunks, sender, segments, every, on_sync)
    handle.seed_report = report
    return handle


def _seed_values(
    segments: list[Segments], checkpoint: Path
) -> tuple[list[Segments], BlockFp8Quantizer | None, SeedReport]:
    """This rank's parts of the checkpoint (its block scales too, if block-fp8), the quantizer, and
    where the trainer's weights, quantized as the checkpoint is, differ from it."""
    try:
        seeded, fp8 = checkpoint_seed(checkpoint, None, segments)
        mine = fp8.apply(segments) if fp8 else segments
    except Fp8ConfigError as e:
        par = Parallel.current()
        raise Fp8ConfigError(
            f"{e} (this rank: TP {par.tp_rank} of {par.tp_size}, expert TP {par.etp_rank} of {par.etp_size})"
        ) from e
    served = {s.name: s.tensor.reshape(-1) for s in seeded}
    report = SeedReport()
    for s in mine:
        ours, theirs = s.tensor.detach().reshape(-1), served[s.name]
        if theirs.dtype != ours.dtype:
            raise TypeError(f"{s.name}: the checkpoint holds {theirs.dtype}, the trainer {ours.dtype}")
        if (local := changed_positions(ours, theirs)).numel():
            prev, pos = report.mismatches.get(s.name), s.to_global(local).cpu()
            report.mismatches[s.name] = pos if prev is None else torch.cat([prev, pos])
    return seeded, fp8, report


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk
