"""`DeltaWorkerExtension` (vLLM's `--worker-extension-cls`): the methods the core reaches on every TP/EP
worker through `collective_rpc`. They return engine/messages.py's messages as dicts and never raise, so
one rank's bad input reaches the door as a status.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from vllm_delta import settings
from vllm_delta.engine import derived, transforms
from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.cli_args import DEFAULT_MAX_STAGED_BYTES
from vllm_delta.engine.commit import ApplyFault
from vllm_delta.engine.digests import Ownership, check_coverage, coverage, refuse_uncovered
from vllm_delta.engine.map_check import check_map
from vllm_delta.engine.messages import (
    CommitReply,
    CoverageReply,
    Done,
    JoinedReply,
    PrepareReply,
    PrepareRequest,
    StatusReply,
    VerifyReply,
    failure,
)
from vllm_delta.engine.replicas import moe_world
from vllm_delta.engine.request import CollectiveInitRequest
from vllm_delta.engine.staging import StagedUpdate
from vllm_delta.engine.trace import WORKER_COMMIT, WORKER_PREPARE, PhaseTimes
from vllm_delta.engine.worker_transfer import Preparing, decode_threads, pull, receive
from vllm_delta.kernels.warmup import warm_up
from vllm_delta.wire import DeltaError, Manifest, check_lineage, check_versions, open_delta
from vllm_delta.wire.checkpoint import Checkpoint
from vllm_delta.wire.container import DeltaDir
from vllm_delta.wire.signing import signing_keys, verify

logger = logging.getLogger(__name__)


@dataclass
class DeltaState:
    """Per-worker lineage and health."""

    applier: DeltaApplier
    version: int = 0
    # The sender run whose lineage the weights are on (None: the checkpoint, or no run vouches for them).
    run_id: str | None = None
    # A commit that failed part-way (version, reason, failed_at, suspect): no serving until an anchor.
    fault: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    staged: dict[str, StagedUpdate] = field(default_factory=dict)
    preparing: Preparing | None = None  # a background prepare (delta_prepare_start), until polled
    # What a full verify checks, per tensor: the whole-tensor digest and xxh3 its latest update stated.
    after: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)


def local_checkpoint_dir(vllm_config: Any) -> str:
    """The served checkpoint's directory (deltas are checked against its safetensors headers): the model
    path, or a hub id's snapshot in the local HF cache, where vLLM fetched it before any worker ran."""
    config = vllm_config.model_config
    if os.path.isdir(config.model):
        return config.model
    from huggingface_hub import snapshot_download

    cache = vllm_config.load_config.download_dir
    return snapshot_download(config.model, revision=config.revision, cache_dir=cache, local_files_only=True)


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    _delta_max_staged: int | None = None  # the staging bound of a request that names none (backend init)

    def _delta(self) -> DeltaState:
        if (state := getattr(self, "_delta_state", None)) is None:
            model, checkpoint = self._delta_model(), Checkpoint.open(local_checkpoint_dir(self.vllm_config))
            applier = DeltaApplier(model, checkpoint.meta, rank=self._delta_rank(), read=checkpoint.read)
            applier.refused.update(derived.discovery(model).refused)
            state = self._delta_state = DeltaState(applier)
        return state

    def _delta_model(self) -> Any:
        return self.model_runner.get_model()

    def _delta_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _delta_parallel(self, key: str, default: int) -> int:
        """`data_parallel_index` (this engine's DP rank, kept for dense models) or `data_parallel_size`
        (above 1 inside an engine only for a MoE model's DP engines: a dense one is reconfigured to 1)."""
        return int(getattr(getattr(self.vllm_config, "parallel_config", None), key, default))

    def delta_prepare_start(self, request: dict[str, Any]) -> dict[str, Any]:
        """Start `delta_prepare` on a background thread, so generation goes on; the placement is learned
        first, on the engine's thread, if the startup probe has not (loaders must not race a forward)."""
        state = self._delta()
        self._delta_join_prepare()  # a prepare a cancelled request left behind
        try:
            typed = PrepareRequest.model_validate(request)
        except ValueError as exc:  # pydantic's ValidationError
            return failure(400, exc)
        try:
            _ = state.applier.placements  # the probe, once
        except Exception as exc:
            return failure(500, exc)
        state.preparing = Preparing(typed.id, lambda: self.delta_prepare(typed))
        return PrepareReply(done=False, rank=self._delta_rank()).wire()

    def delta_prepare_poll(self, request_id: str) -> dict[str, Any]:
        """`{"done": False}` while the background prepare runs, then its reply (with `prepare_s`)."""
        preparing = self._delta().preparing
        if preparing is None or preparing.request_id != request_id:
            return failure(409, KeyError(f"no prepare running for {request_id!r}"))
        if preparing.is_alive():
            return PrepareReply(done=False, rank=self._delta_rank()).wire()
        self._delta().preparing = None
        return {**preparing.reply, "done": True, "prepare_s": time.perf_counter() - preparing.began}

    def _delta_join_prepare(self) -> None:
        """Wait for a background prepare nobody polls any more and drop what it staged."""
        if (preparing := self._delta().preparing) is not None:
            preparing.join()
            self._delta().preparing = None
            self.delta_abort(preparing.request_id)

    def delta_prepare(self, request: dict[str, Any] | PrepareRequest) -> dict[str, Any]:
        """Phase 1: read, verify, decode and locate; no weight changes."""
        state = self._delta()
        try:
            request = PrepareRequest.model_validate(request)
            max_staged = request.max_staged_bytes or self._delta_max_staged or DEFAULT_MAX_STAGED_BYTES
            admit = partial(self._delta_admit, request=request)
            same = {"version": request.version, "base_version": request.base_version}
            same |= {"current_version": state.version, "max_staged_bytes": max_staged}
            stage = partial(state.applier.prepare, **same)
            if request.transport == "collective":
                try:
                    manifest, staged = receive(getattr(self, "_delta_group", None), request, admit, stage)
                except DeltaError:
                    self._delta_drop_group()  # the trainer drops its end after any refusal
                    raise
            elif request.store_path is not None:
                from vllm_delta.transports.s3 import configured_store

                if getattr(self, "_delta_store", None) is None:  # one client, and its pool, for life
                    self._delta_store = configured_store()
                owned = state.applier.owned_ranges()
                manifest, staged = pull(self._delta_store, request.store_path, admit, owned, stage)
            else:
                times = PhaseTimes()  # the manifest's parse: tenths of a second at 10k tensors
                with times.phase("receive"):
                    # Opened again from the root's handle, through no symlink (the door checked the path).
                    delta_dir = DeltaDir.open(request.path, root=request.root)
                    seed = settings.allow_seed_format()
                    opened = open_delta(delta_dir, files=request.files, allow_seed=seed)
                    manifest = opened.manifest
                    self._delta_admit(manifest, request)  # before any flush is read
                threads = decode_threads(state.applier.model)
                staged = state.applier.prepare(
                    opened, files=request.files, decode_threads=threads, times=times, **same
                )
            refuse_uncovered(state.applier.coverage)  # after a collective receive, so a trainer never blocks
            run_id = self._delta_check_lineage(manifest, request, anchor=staged.anchor)
        except DeltaError as exc:
            return failure(exc.http_status, exc)
        except (OSError, ValueError) as exc:
            return failure(400, exc)
        if state.fault is not None and not staged.anchor:
            why = f"engine is dirty since a failed commit of version {state.fault['version']} "
            why += "(only a full anchor or a restart repairs it)"
            return failure(500, RuntimeError(why), fault=state.fault)
        staged.run_id = run_id
        state.staged = {request.id: staged}
        same = ("changed", "total_changed", "bytes_read", "decode_s", "replay", "anchor", "digests")
        return PrepareReply(
            **{k: getattr(staged, k) for k in same},
            rank=self._delta_rank(),
            fallback=staged.fallback_names,
            staged_bytes=staged.staged_bytes,
            expected=staged.expected if self._delta_rank() == 0 else None,  # the same on every rank
            phases=staged.times.as_dict(WORKER_PREPARE),
        ).wire()

    def delta_commit(self, request_id: str) -> dict[str, Any]:
        """Phase 2: scatter what `delta_prepare` staged. A failure here leaves a `Fault` until an anchor."""
        state = self._delta()
        if request_id not in state.staged:
            return failure(409, KeyError(f"no prepared update {request_id!r}"))
        staged = state.staged.pop(request_id)
        try:
            apply_s = state.applier.commit(staged)
        except ApplyFault as exc:
            state.fault = dict(
                version=staged.version, reason=str(exc), failed_at=exc.failed_at, suspect=exc.suspect
            )
            logger.exception(
                "delta updates: commit of version %d failed; suspect %s", staged.version, exc.suspect
            )
            return {**failure(500, exc, fault=state.fault), "rank": self._delta_rank()}
        if staged.anchor:
            state.fault = None
            state.after = {}
        state.after.update(staged.after)
        state.version, state.run_id = staged.version, staged.run_id
        last = ("version", "changed", "bytes_read", "decode_s", "replay", "staged_bytes", "max_staged_bytes")
        state.last = {**{k: getattr(staged, k) for k in last}, "apply_s": apply_s, "time": time.time()}
        phases = staged.times.as_dict(WORKER_COMMIT)
        return CommitReply(
            rank=self._delta_rank(), apply_s=apply_s, version=state.version, phases=phases
        ).wire()

    def _delta_admit(self, manifest: Manifest, request: PrepareRequest) -> None:
        """The one check of a manifest before any flush is read or received, whatever the transport or
        door: its signature (403, with signing keys), then its lineage (409)."""
        verify(manifest, signing_keys(settings.signing_keys()))
        self._delta_check_lineage(manifest, request)

    def _delta_check_lineage(
        self, manifest: Manifest, request: PrepareRequest, anchor: bool = True
    ) -> str | None:
        """Refuse (409) a delta for other weights than ours (`wire.lineage`); the run id after it applies."""
        state = self._delta()
        v, current = request.version, state.version
        run_id = check_lineage(
            manifest.lineage, version=v, engine_version=current, engine_run_id=state.run_id, anchor=anchor
        )
        check_versions(manifest, version=v, base_version=request.base_version, engine_version=current)
        return run_id

    def delta_coverage(self) -> dict[str, Any]:
        """Which checkpoint elements this rank holds (source lattices per tensor), for its peers."""
        applier = self._delta().applier
        placements = applier.placements
        live = {n: t for n, (t, _) in transforms.canonical_tensors(applier.model).items()}  # probe's targets
        errors = check_map(applier._load_weights, live, placements, applier.checkpoint)
        return CoverageReply(
            rank=self._delta_rank(),
            coverage=coverage(placements),
            unread=[n for n, p in placements.items() if not p.read],
            fallback=[n for n, p in placements.items() if p.fallback_reason],
            map_errors=errors,
        ).wire()

    def delta_set_peers(
        self, coverages: list[dict[str, Any]], replicas: list | None = None
    ) -> dict[str, Any]:
        """Count, in digests, only the elements no lower rank holds (replies of `delta_coverage`); under DP,
        `replicas` pairs each dp index with its ranks' replies: a dense replica is checked on its own, the
        DP engines of a MoE model as one world (`replicas.moe_world`)."""
        applier, rank = self._delta().applier, self._delta_rank()
        dp = self._delta_parallel("data_parallel_index", 0)
        shapes = {n: shape for n, (shape, _) in applier.checkpoint.items()}
        groups, across = {int(i): group for i, group in replicas or ()}, None
        if groups and self._delta_parallel("data_parallel_size", 1) > 1:
            try:
                applier.ownership, applier.coverage, across = moe_world(groups, dp, rank, shapes)
            except ValueError as exc:  # refuses every update, as a hole would
                applier.coverage = {"ok": False, "errors": {"(data parallel)": str(exc)}, "ignored": []}
                across = []
        else:
            coverages = groups[dp] if groups else coverages
            ordered = [c["coverage"] for c in sorted(coverages, key=lambda c: c["rank"])]
            applier.ownership = Ownership.from_coverages(ordered, rank)
            # Holes or overlaps across ranks refuse every update (prepare) and show in the status.
            applier.coverage = check_coverage(coverages, shapes)
        across = across if rank == 0 else None  # the same on every rank
        return CoverageReply(rank=rank, coverage=applier.coverage, across_dp=across).wire()

    def delta_verify(self) -> dict[str, Any]:
        """Full verify of the current weights: counted-once whole-tensor digests, xxh3 where held whole."""
        state, start = self._delta(), time.perf_counter()
        applier, after = state.applier, state.after
        digests = {n: [None, applier.whole_partial(n)] for n, (d, _) in after.items() if d is not None}
        hash_checked, hash_bad = applier.post_hash_mismatches({n: h for n, (_, h) in after.items() if h})
        expected = {n: [None, d] for n, (d, _) in after.items() if d is not None}
        return VerifyReply(
            rank=self._delta_rank(),
            digests=digests,
            hash_checked=hash_checked,
            hash_mismatched=hash_bad,
            verify_s=time.perf_counter() - start,
            expected=expected if self._delta_rank() == 0 else None,
        ).wire()

    def delta_collective_init(self, config: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's group as rank `rank_offset` + this worker's, dropping an older one."""
        from vllm_delta.transports.groups import join_group

        self._delta_drop_group()
        try:
            init = CollectiveInitRequest.model_validate(config)
            rank = init.rank_offset + self._delta_rank()
            self._delta_group = join_group(rank=rank, **init.model_dump(exclude={"rank_offset"}))
        except Exception as exc:
            return failure(500, exc)
        return JoinedReply(rank=self._delta_rank(), group_rank=self._delta_group.rank).wire()

    def _delta_drop_group(self) -> None:
        group, self._delta_group = getattr(self, "_delta_group", None), None
        if group is not None:
            group.close()

    def delta_probe(self) -> dict[str, Any]:
        """Learn the placement and compile the kernels now, so the first update pays neither."""
        applier = self._delta().applier
        warm_up({p.dtype for p in applier.placements.values()} | {t.dtype for t in applier.targets.values()})
        gc.collect()  # then the startup heap (model, placement) frozen out of every later collection, as
        gc.freeze()  # vLLM's GPU worker does after its warm-up: a sync's collections walk what it made
        atexit.register(gc.unfreeze)  # collected at exit, so bindings (triton's nanobind) report no leaks
        return applier.placement_status()

    def delta_abort(self, request_id: str) -> dict[str, Any]:
        preparing = self._delta().preparing
        if preparing is not None and preparing.request_id == request_id:
            self._delta_join_prepare()  # let it finish, then drop what it staged
        else:
            self._delta().staged.pop(request_id, None)
        return Done(rank=self._delta_rank()).wire()

    def delta_status(self) -> dict[str, Any]:
        state = self._delta()
        return StatusReply(
            rank=self._delta_rank(),
            version=state.version,
            run_id=state.run_id,
            dirty=state.fault is not None,
            dirty_reason=state.fault and state.fault["reason"],
            fault=state.fault,
            last=state.last,
            placement=state.applier.placement_status(),
            fallback=state.applier.fallback_tensors if state.applier.probed else None,
        ).model_dump(exclude={"status", "error", "dp"})
