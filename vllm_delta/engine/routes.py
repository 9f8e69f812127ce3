"""`vllm.endpoint_plugins` entry point: `POST /update_weights_delta` and `GET /delta_updates/status`.

Why this shape: the workers do the work in two phases (`delta_prepare` reads, verifies and decodes
while generation runs; `delta_commit` scatters), so the route pauses generation only around the
commit, and not at all for an empty delta. Updates run one at a time. The routes exist only when
`vllm serve` got `--enable-delta-updates`, and they obey `--api-key` themselves, because vLLM's
authentication middleware guards only the `/v1`-style prefixes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from argparse import Namespace
from pathlib import Path
from time import perf_counter
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import REGISTRY
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import State
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_delta.engine.cli_args import DEFAULT_MAX_BODY_BYTES, PLUGIN_NAME, api_keys, check_args
from vllm_delta.engine.digests import check_partials, mismatches
from vllm_delta.engine.http_errors import UpdateError, bad_request
from vllm_delta.engine.liveness import while_alive
from vllm_delta.engine.metrics import delta_metrics
from vllm_delta.engine.replicas import across_dp, by_replica, digest_groups, rank_id, rpc_all
from vllm_delta.wire.errors import DeltaError
from vllm_delta.engine.request import (CollectiveInitRequest, DeltaUpdateRequest, NotADeltaDirError, OutsideRootError,
                                       check_collective, read_body, resolve_version_dir, store_version_key)
from vllm_delta.native import routes as native_routes
from vllm_delta.transports.store import StoreURL

# Under vLLM's logger, so these lines land in the server log with vLLM's own.
logger = logging.getLogger("vllm.delta_updates")
router = APIRouter()
PREPARE_POLL_S = 0.05  # between polls of a background prepare: short next to any real prepare


class DeltaUpdatesEndpoint:
    """The route plugin; inert unless `--enable-delta-updates` was given."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        args = getattr(app.state, "args", None)
        if getattr(args, "enable_delta_updates", False):
            check_args(args)
            app.include_router(router)
            guard_health(app)
        if native_routes.enabled(args):  # vLLM's weight routes, for `--weight-transfer-config` backend delta
            native_routes.attach(app)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        if native_routes.enabled(args):
            state.delta_native = native_routes.NativeUpdater(engine_client)
        if not getattr(args, "enable_delta_updates", False):
            return
        if engine_client is None:
            raise RuntimeError("--enable-delta-updates needs an engine; this server has none")
        state.delta_updater = DeltaUpdater(engine_client, args.delta_updates_root,
                                           args.delta_updates_chunk_bytes, api_keys(args),
                                           collective_trainers=args.delta_updates_collective_trainers,
                                           max_body_bytes=args.delta_updates_max_body_bytes)
        state.delta_updater.start_probe()


class DeltaUpdater:
    """Runs updates against the engine, one at a time."""

    def __init__(self, engine: Any, root: Path | StoreURL, chunk_bytes: int, tokens: list[str], *,
                 collective_trainers: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.root = root
        self.chunk_bytes = chunk_bytes
        self.collective_trainers = collective_trainers
        self.max_body_bytes = max_body_bytes
        # vLLM's own bearer-key check (sha256 digests, constant-time compare); its middleware itself
        # guards only the `/v1` prefix, so these routes call it.
        self._auth = AuthenticationMiddleware(None, tokens) if tokens else None
        self._lock = asyncio.Lock()
        self._peers_set = False
        # Tensors split across the DP engines of a MoE model, checked over all of them (set with the peers).
        self._across_dp: frozenset[str] | None = None
        # Set when a commit failed part-way: generation stays paused and /health fails until an
        # anchor commits on every rank (or the server restarts).
        self.fault: dict[str, Any] | None = None
        # Set by the startup probe: tensors whose loader cannot be served exactly. Updates are
        # refused and /health fails, as a refusal to start would (the probe runs after startup).
        self.refused: dict[str, str] = {}

    def authorize(self, request: Request) -> None:
        """Refuse (401) a request without a valid `Authorization: Bearer` key, if keys are set."""
        if self._auth is not None and not self._auth.verify_token(request.headers):
            raise UpdateError(401, "Unauthorized", "missing or wrong API key")

    async def update(self, body: DeltaUpdateRequest) -> dict[str, Any]:
        req = {"id": uuid.uuid4().hex, "version": body.version, "base_version": body.base_version,
               "chunk_bytes": self.chunk_bytes}
        if body.transport == "collective":
            check_collective(None, self.collective_trainers)
            req.update(transport="collective", manifest=body.manifest)
        elif isinstance(self.root, StoreURL):
            # The workers fetch from their own configured root; only the checked relative path travels.
            try:
                store_version_key(body.path, self.root)
            except OutsideRootError as exc:
                raise UpdateError(403, "PathOutsideRoot", str(exc)) from None
            if body.files is not None:
                raise UpdateError(400, "InvalidRequest", "`files` selects flushes of a disk delta; a store "
                                  "delta is read whole, as its manifest lists it")
            req.update(store_path=body.path)
        else:
            try:
                path = resolve_version_dir(body.path, self.root)
            except OutsideRootError as exc:
                raise UpdateError(403, "PathOutsideRoot", str(exc)) from None
            except NotADeltaDirError as exc:
                raise UpdateError(400, "NotADeltaDirectory", str(exc)) from None
            req.update(path=str(path), root=str(self.root), files=body.files)
        if self.refused:
            raise UpdateError(500, "UnservableLoader", f"delta updates refused at startup: {self.refused}")
        async with self._lock:
            try:
                await self._ensure_peers()
                tokens_before, started = generation_tokens(), perf_counter()
                prepared = await self._prepare(req)
                prepare_s, tokens_after = perf_counter() - started, generation_tokens()
                if failed := next((r for r in prepared if not r.get("ok")), None):
                    raise with_ranks(UpdateError.from_worker(failed), prepared)
                check_replicas(prepared, self._across_dp)  # partial digests of the changed positions, before any write
            except BaseException:  # a refusal, or the client went away mid-prepare
                await self._abort(req["id"])  # ranks that did prepare drop their staged state
                raise
            committed, pause_s = await self._commit(req["id"], pause=prepared[0]["total_changed"] > 0,
                                                    anchor=all(r.get("anchor") for r in prepared))
        if failed := next((r for r in committed if not r.get("ok")), None):
            raise with_ranks(UpdateError.from_worker(failed), committed)
        tokens = None if tokens_before is None or tokens_after is None else tokens_after - tokens_before
        return {**summarize(prepared, committed, pause_s), "prepare_s": prepare_s, "tokens_during_prepare": tokens}

    async def _prepare(self, req: dict[str, Any]) -> list[dict]:
        """Every rank prepares on a background thread while the engine keeps generating; their replies.

        The polls are cheap RPCs between engine steps; the sleeps between them hand the engine
        core back to the scheduler.
        """
        started = await self._rpc("delta_prepare_start", req)
        if failed := next((r for r in started if not r.get("ok")), None):
            return [failed]
        replies: dict[int, dict] = {}
        while True:
            for i, reply in enumerate(await self._rpc("delta_prepare_poll", req["id"])):
                if reply.get("done") or not reply.get("ok"):
                    replies.setdefault(i, reply)
            if len(replies) == len(started):
                return [replies[i] for i in range(len(started))]
            await asyncio.sleep(PREPARE_POLL_S)

    async def _ensure_peers(self) -> None:
        """Once: every rank learns which elements lower ranks hold, so digests count each once: per
        replica where each DP replica holds the whole model (dense), and over all DP engines for the
        tensors a MoE model splits across them (engine/replicas.py)."""
        if not self._peers_set:
            replicas = by_replica(await self._rpc("delta_coverage"))
            if len(replicas) == 1:
                checked = await self._rpc("delta_set_peers", next(iter(replicas.values())))
            else:
                checked = await self._rpc("delta_set_peers", [], [[dp, group] for dp, group in replicas.items()])
            try:
                self._across_dp = across_dp(checked)
            except ValueError as exc:
                raise UpdateError(500, "CoverageError", str(exc)) from None
            for bad in (c for c in checked if not c["coverage"]["ok"]):
                logger.error("delta updates: placement coverage check failed on %s; updates are refused: %s",
                             rank_id(bad), bad["coverage"]["errors"])
            self._peers_set = True

    async def verify(self) -> dict[str, Any]:
        """Full verify of the served weights against the digests and hashes of the updates so far."""
        async with self._lock:
            await self._ensure_peers()
            replies = await self._rpc("delta_verify")
        groups = digest_groups(replies, self._across_dp)  # each replica, then (MoE) the tensors split across DP
        replicas = []
        for (_, group), (dp, ranks) in zip(groups, by_replica(replies).items()):
            checked, bad = mismatches(group)  # each replica against the digests of what it holds whole
            replicas.append({"dp": dp, "digests_checked": checked, "digest_mismatched": [b[0] for b in bad],
                             "hash_mismatched": sorted({n for r in ranks for n in r["hash_mismatched"]})})
        extra: dict[str, Any] = {}
        if self._across_dp:  # a MoE model's tensors split across the DP engines, against all of them
            checked, bad = mismatches(groups[-1][1])
            extra["across_dp"] = {"digests_checked": checked, "digest_mismatched": [b[0] for b in bad]}
        checks = [*replicas, *extra.values()]
        digest_bad = sorted({n for r in checks for n in r["digest_mismatched"]})
        hash_bad = sorted({n for r in replicas for n in r["hash_mismatched"]})
        return {"ok": not digest_bad and not hash_bad, "digests_checked": sum(r["digests_checked"] for r in checks),
                "digest_mismatched": digest_bad, "hashes_checked": sum(r["hash_checked"] for r in replies),
                "hash_mismatched": hash_bad, "verify_s": max(r["verify_s"] for r in replies), "replicas": replicas,
                **extra}

    async def _commit(self, req_id: str, pause: bool, anchor: bool = False) -> tuple[list[dict], float]:
        """Commit, pausing generation (and dropping the now stale prefix cache) around it.

        If any rank fails, generation stays paused and `fault` is set: partly written weights
        are never served. A later anchor that commits on every rank clears it and resumes.
        """
        if not pause:
            return await self._rpc("delta_commit", req_id), 0.0
        started = perf_counter()
        try:
            await while_alive(self.engine, self.engine.pause_generation(mode="keep", clear_cache=True))
        except EngineDeadError:
            raise
        except Exception as exc:
            await self._abort(req_id)
            raise UpdateError(500, "EngineError", f"could not pause generation: {exc}") from exc
        committed: list[dict] = []
        try:
            committed = await self._rpc("delta_commit", req_id)
        finally:
            failed = [r for r in committed if not r.get("ok")] if committed else [{}]  # [{}]: the RPC raised
            if failed:
                self.fault = fault_of(failed)
                logger.error("delta updates: commit failed; generation stays paused: %s", self.fault)
            else:
                if anchor:
                    self.fault = None
                if self.fault is None:
                    await while_alive(self.engine, self.engine.resume_generation())
        return committed, perf_counter() - started

    async def collective_init(self, body: CollectiveInitRequest) -> dict[str, Any]:
        """Every worker joins the trainer's group (each worker is rank `rank_offset + its rank`)."""
        check_collective(body.master_addr, self.collective_trainers)
        ranks = await self._rpc("delta_status")
        if len(by_replica(ranks)) > 1:  # each worker would join as rank_offset + its rank in its own replica
            raise UpdateError(400, "InvalidRequest", "the collective transport cannot serve data-parallel "
                              "replicas: their workers would take the same group ranks; use a disk or store root")
        if body.world_size != body.rank_offset + len(ranks):
            raise UpdateError(400, "InvalidRequest", f"world_size {body.world_size} != rank_offset "
                              f"{body.rank_offset} + {len(ranks)} engine ranks")
        async with self._lock:
            joined = await self._rpc("delta_collective_init", body.model_dump())
        if failed := next((r for r in joined if not r.get("ok")), None):
            raise UpdateError.from_worker(failed)
        return {"ranks": [r["group_rank"] for r in joined], "world_size": body.world_size}

    def start_probe(self) -> None:
        """Learn the placement on every rank now, in the background, before any update needs it."""

        async def probe() -> None:
            try:
                self.refused = refused_of(await self._rpc("delta_probe"))
                async with self._lock:  # then check, across ranks, that every element is held
                    await self._ensure_peers()
            except (UpdateError, EngineDeadError):
                pass  # _rpc logged it; the first update probes again and reports the error

        self._probe = asyncio.get_running_loop().create_task(probe())

    async def status(self) -> dict[str, Any]:
        ranks = await self._rpc("delta_status")
        versions = {r["version"] for r in ranks}
        runs = {r["run_id"] for r in ranks}  # whose lineage the weights are on (None: the checkpoint's)
        dirty = [r["dirty_reason"] or "dirty" for r in ranks if r["dirty"]]
        agree = len(versions) == 1 and len(runs) == 1
        return {"version": ranks[0]["version"] if agree else None, "run_id": ranks[0]["run_id"] if agree else None,
                "weight_version": await while_alive(self.engine, self.engine.get_weight_version()),
                "healthy": not dirty and agree and self.fault is None and not self.refused, "dirty_reasons": dirty,
                "fault": self.fault, "placement": placement_summary([r["placement"] for r in ranks]),
                "last": ranks[0]["last"], "ranks": ranks, "replicas": replica_status(ranks)}

    async def _abort(self, req_id: str) -> None:
        """Drop a prepared update on every rank; a failure here must not hide the first error."""
        try:
            await self._rpc("delta_abort", req_id)
        except (UpdateError, EngineDeadError):
            pass  # _rpc logged it, or there is nothing left to abort

    async def _rpc(self, method: str, *args: Any) -> list[dict]:
        """Call every worker of every DP replica (replies tagged `dp`); an exception there (not a
        reported failure) is a 500."""
        try:
            return await while_alive(self.engine, rpc_all(self.engine, method, args))
        except EngineDeadError:
            logger.error("delta updates: an engine core died during %s", method)
            raise  # vLLM's handler answers it and shuts the server down
        except Exception as exc:
            logger.exception("delta updates: %s failed on a worker", method)
            raise UpdateError(500, "EngineError", f"{method} failed on a worker: {exc}") from exc


def generation_tokens() -> float | None:
    """vLLM's `vllm:generation_tokens` counter in this process (all engines), or None where it is absent."""
    for metric in REGISTRY.collect():
        if metric.name == "vllm:generation_tokens":
            return sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return None


def refused_of(ranks: list[dict]) -> dict[str, str]:
    """Tensors whose loader a rank cannot serve exactly (engine/fallback.py), with the reason."""
    return {n: reason for r in ranks for n, reason in (r.get("refused") or {}).items()}


def placement_summary(ranks: list[dict]) -> dict[str, Any]:
    """The ranks' placement status as one: ready when all are, the slowest probe, the largest peak."""
    ready = all(r["ready"] for r in ranks)
    return {"ready": ready, "probe_s": max((r["probe_s"] or 0.0 for r in ranks), default=None) if ready else None,
            "probe_peak_bytes": max((r["probe_peak_bytes"] or 0 for r in ranks), default=None) if ready else None,
            "fallback": sorted({n for r in ranks for n in (r["fallback"] or {})}) if ready else None,
            "refused": refused_of(ranks) if ready else None,
            "transformed": sorted({n for r in ranks for n in r["transformed"]}),
            "coverage": ranks[0].get("coverage")}  # the same check on every rank


def fault_of(failed: list[dict]) -> dict[str, Any]:
    """One fault record from the failed ranks' commit replies: the version, where, what is suspect."""
    faults = [(r.get("error") or {}).get("fault") or {} for r in failed]
    return {"version": next((f["version"] for f in faults if "version" in f), None),
            "failed_at": next((f["failed_at"] for f in faults if f.get("failed_at")), None),
            "suspect": sorted({n for f in faults for n in f.get("suspect", [])}),
            "ranks": [r.get("rank") for r in failed], "rank_ids": [rank_id(r) for r in failed]}


def check_replicas(prepared: list[dict], split: frozenset[str] | None = None) -> None:
    """Each DP replica's partial digests add up to the manifest on their own, and those of tensors `split`
    across a MoE model's DP engines over all of them (a 4xx naming the replica, or the DP engines, if not)."""
    for where, group in digest_groups(prepared, split):
        try:
            check_partials(group)
        except DeltaError as exc:
            raise with_ranks(UpdateError(exc.http_status, type(exc).__name__, where + exc.reason, param=exc.param),
                             prepared) from None


def with_ranks(err: UpdateError, replies: list[dict]) -> UpdateError:
    """`err` with every rank's outcome (`dp<i>:rank<r>` -> ok, status), so a client sees which replica refused."""
    err.error["ranks"] = {rank_id(r): {"ok": bool(r.get("ok")), "status": r.get("status", 200 if r.get("ok") else 500)}
                          for r in replies}
    return err


def replica_status(ranks: list[dict]) -> list[dict[str, Any]]:
    """Per DP replica: its version (None if its ranks disagree) and whether it is clean."""
    out = []
    for dp, group in by_replica(ranks).items():
        versions = {r["version"] for r in group}
        out.append({"dp": dp, "version": versions.pop() if len(versions) == 1 else None,
                    "dirty": any(r["dirty"] for r in group), "ranks": len(group)})
    return out


def summarize(prepared: list[dict], committed: list[dict], pause_s: float) -> dict[str, Any]:
    """One answer for all ranks: the slowest rank's times, the largest read, the union of fallbacks."""
    versions = {r["version"] for r in committed}
    if len(versions) != 1:
        raise UpdateError(500, "EngineError", f"ranks committed different versions: {sorted(versions)}")
    ranks = [{k: v for k, v in {**p, **c}.items() if k != "ok"} for p, c in zip(prepared, committed)]
    return {
        "version": versions.pop(),
        "changed": prepared[0]["total_changed"],
        "bytes_read": max(r["bytes_read"] for r in prepared),
        "decode_s": max(r["decode_s"] for r in prepared),
        "apply_s": max(r["apply_s"] for r in committed),
        "pause_s": pause_s,
        "replay": all(r["replay"] for r in prepared),
        "fallback": sorted({name for r in prepared for name in r["fallback"]}),
        "ranks": ranks,
        "replicas": [{"dp": dp, "version": group[0]["version"], "ranks": len(group)}
                     for dp, group in by_replica(committed).items()],
    }


def _updater(request: Request) -> DeltaUpdater:
    updater: DeltaUpdater = request.app.state.delta_updater
    updater.authorize(request)
    return updater


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`; a malformed one is a 400, one past the size cap a 413."""
    try:
        return model.model_validate_json(await read_body(request, request.app.state.delta_updater.max_body_bytes))
    except ValidationError as exc:
        raise bad_request(exc) from None


@router.post("/update_weights_delta")
async def update_weights_delta(request: Request) -> JSONResponse:
    try:
        updater = _updater(request)
        result = await updater.update(await _body(request, DeltaUpdateRequest))
    except UpdateError as err:
        logger.warning("delta update refused (%d): %s", err.status, err.error["message"])
        delta_metrics().failed(err.status)
        return err.response()
    except EngineDeadError:
        delta_metrics().failed(500)
        raise
    delta_metrics().observe(result)
    logger.info("delta update to version %d: %d changed, decode %.3fs, apply %.3fs, paused %.3fs",
                result["version"], result["changed"], result["decode_s"], result["apply_s"], result["pause_s"])
    return JSONResponse(result)


@router.post("/delta_updates/collective/init")
async def delta_collective_init(request: Request) -> JSONResponse:
    try:
        updater = _updater(request)
        return JSONResponse(await updater.collective_init(await _body(request, CollectiveInitRequest)))
    except UpdateError as err:
        logger.warning("collective init refused (%d): %s", err.status, err.error["message"])
        return err.response()


@router.post("/delta_updates/verify")
async def delta_updates_verify(request: Request) -> JSONResponse:
    try:
        return JSONResponse(await _updater(request).verify())
    except UpdateError as err:
        return err.response()


def guard_health(app: FastAPI) -> None:
    """`/health` answers 503 while a failed commit left weights suspect, so load balancers drain us."""

    @app.middleware("http")
    async def delta_health(request: Request, call_next):
        updater = getattr(request.app.state, "delta_updater", None)
        if request.url.path == "/health" and updater is not None and updater.fault is not None:
            return JSONResponse(status_code=503, content={"error": {
                "type": "DeltaCommitFault", "message": "a delta commit failed; weights are suspect",
                "fault": updater.fault}})
        if request.url.path == "/health" and updater is not None and updater.refused:
            return JSONResponse(status_code=503, content={"error": {
                "type": "UnservableLoader", "message": "delta updates cannot be served exactly for some tensors",
                "refused": updater.refused}})
        return await call_next(request)


@router.get("/delta_updates/status")
async def delta_updates_status(request: Request) -> JSONResponse:
    try:
        return JSONResponse(await _updater(request).status())
    except UpdateError as err:
        return err.response()
