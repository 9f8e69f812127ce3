"""Worker-side half of `benchmarks/apply.py`: functions run inside the vLLM worker process.

Each function is sent with `llm.collective_rpc(fn, args=...)`; vLLM calls it with the worker as
its first argument (this module must be importable in the worker, which `apply.py` arranges via
PYTHONPATH). Every measurement returns wall seconds and the peak extra resident memory of the
worker process: the kernel's high-water mark (VmHWM) is reset through /proc/self/clear_refs
right before the measured call, so the peak is exact (no sampling gaps), and the baseline is
the RSS at that moment (after gc and malloc_trim, with everything prepared "in advance" already
resident).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _settle() -> None:
    gc.collect()
    _LIBC.malloc_trim(0)


class PeakRss:
    """Peak extra RSS of this process over the block, in bytes (exact, via VmHWM)."""

    def __enter__(self) -> PeakRss:
        _settle()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.base = _status_kib("VmRSS") << 10
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self.peak = _status_kib("VmHWM") << 10
        self.extra = self.peak - self.base


@contextlib.contextmanager
def _split_at_repack(marks: dict[str, int]) -> Iterator[None]:
    """Splits a prepare's peak at the CPU repack built ahead (`commit.prebuild_touched`, the last step of
    prepare; nothing it makes exists without a repack): the peak before it is read and reset there."""
    from vllm_delta.engine import commit

    real = commit.prebuild_touched

    def split(*args, **kwargs):
        marks["stage_peak"] = _status_kib("VmHWM") << 10
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return real(*args, **kwargs)

    commit.prebuild_touched = split
    try:
        yield
    finally:
        commit.prebuild_touched = real


def _applier(worker):
    return worker._delta().applier


def _payload_bytes(changed: int) -> int:
    # Decoded positions (int64) + values (bf16) per changed element.
    return changed * (8 + 2)


def info(worker) -> dict[str, Any]:
    """Model facts: params, threads, what vLLM's CPU post-load step transformed."""
    from vllm_delta.engine import derived

    model = worker.model_runner.get_model()
    stashed, restored = [], []
    for unit in derived.discovery(model).units:
        stashed += [f"{unit.name}.{n}" for n in unit.canonical]
        restored += [f"{unit.name}.{k[6:]}" for k, kind in unit.derived.items() if kind == "emptied"]
    return {
        "torch_threads": torch.get_num_threads(),
        "rss": _status_kib("VmRSS") << 10,
        "live_params": sum(p.numel() for p in model.parameters()),
        "stashed": stashed,
        "restored": len(restored),
        "restored_example": restored[:3],
    }


def learn_placement(worker) -> dict[str, Any]:
    """The placement probe (the route runs it at engine start): its own time and peak, and ours around it."""
    applier = _applier(worker)
    with PeakRss() as m:
        status = worker.delta_probe()
    return {
        "seconds": m.seconds,
        "extra": m.extra,
        "probe_s": status["probe_s"],
        "probe_peak_bytes": status["probe_peak_bytes"],
        "tensors": len(applier.placements),
        "fallback": status["fallback"],
        "transformed": status["transformed"],
    }


def ours(worker, path: str, version: int, max_staged_bytes: int) -> dict[str, Any]:
    """Our apply as the route runs it: `delta_prepare`, the digest check, `delta_commit`.

    The worker's version counter is set to `version - 1` first so the same delta directories can
    be replayed across the run (lineage checks are not what is measured). Phase times come from
    the staged update's trace (`StagedUpdate.times`, engine/trace.py): `stage` is the prepare after
    reading the manifest (decode, locate, digests, staging), `digest` the additive digests of the
    changed positions, `post_load` the CPU repack in the commit; `scatter` is the commit minus repack.
    """
    from vllm_delta.engine.digests import check_partials

    state = worker._delta()
    state.version = version - 1
    request = {
        "id": f"bench-{version}",
        "path": path,
        "version": version,
        "base_version": None,
        "max_staged_bytes": max_staged_bytes,
    }
    marks: dict[str, int] = {}
    with PeakRss() as prep, _split_at_repack(marks):
        prepared = worker.delta_prepare(request)
        if not prepared.get("ok"):
            raise RuntimeError(f"delta_prepare failed: {prepared}")
        checked = check_partials([prepared])  # the route's check, before any write
    staged = state.staged[request["id"]]
    trace = staged.times  # the commit adds its phases to the same trace
    staged_bytes = staged.staged_bytes
    del staged
    with PeakRss() as com:  # the staged update (the payload) is resident at its start
        committed = worker.delta_commit(request["id"])
    if not committed.get("ok"):
        raise RuntimeError(f"delta_commit failed: {committed}")
    times = trace.seconds
    # The CPU repack: built while serving (`prebuild`, in prepare), swapped in by the commit (`post_load`).
    repack = times.get("prebuild", 0.0) + times.get("post_load", 0.0)
    out = {
        "changed": prepared["changed"],
        "payload": _payload_bytes(prepared["changed"]),
        "bytes_read": prepared["bytes_read"],
        "fallback": prepared["fallback"],
        "digests_checked": checked,
        "prepare_s": prep.seconds,
        "stage_s": sum(times.get(p, 0.0) for p in ("decode", "locate", "digest", "stage")),
        "digest_s": times.get("digest", 0.0),
        "phases": trace.as_dict(),
        "commit_s": com.seconds,
        "repack_s": repack,
        "scatter_s": com.seconds - times.get("post_load", 0.0),
        "total_s": prep.seconds + com.seconds,
        # Peaks relative to the RSS before prepare: the prepare's up to the repack built ahead (read, decode,
        # locate, digests, the staged chunks), the prepare's whole, the commit's.
        "stage_extra": marks.get("stage_peak", prep.peak) - prep.base,
        "prepare_extra": max(marks.get("stage_peak", 0), prep.peak) - prep.base,
        "commit_extra": com.peak - prep.base,
        # Held from prepare to commit (RSS after gc and malloc_trim): the staged chunks, and the packed
        # copies the repack built ahead (freed with the old handlers they replace at commit).
        "staged": staged_bytes,
        "prebuilt_bytes": com.base - prep.base - staged_bytes,
    }
    out["extra"] = max(out["prepare_extra"], out["commit_extra"])
    # Less what exists only because of the CPU repack (its packed copies, the weight copies they are
    # built from): what an engine with no repack (a GPU's) holds over its weights.
    out["extra_no_repack"] = max(out["stage_extra"], out["commit_extra"] - out["prebuilt_bytes"])
    return out


def gemm_paths(worker, batch: int, repeats: int = 20) -> dict[str, Any]:
    """One MLP layer's matmul through vLLM's packed CPU kernel vs plain `F.linear` on the checkpoint
    layout (what serving updated layers unpacked would cost per call), median seconds."""
    model = worker.model_runner.get_model()
    try:
        layer = model.model.layers[0].mlp.gate_up_proj
        return _gemm_paths(layer, batch, repeats)
    except Exception as exc:  # a side measurement: report why, keep the benchmark's run
        return {"batch": batch, "error": f"{type(exc).__name__}: {exc}"}


def _gemm_paths(layer, batch: int, repeats: int) -> dict[str, Any]:
    import statistics

    x = torch.randn(batch, layer.weight.shape[1], dtype=layer.weight.dtype)
    out = {"layer": "model.layers.0.mlp.gate_up_proj", "shape": list(layer.weight.shape), "batch": batch}
    for label, fn in (
        ("packed_s", lambda: layer.quant_method.apply(layer, x)),
        ("unpacked_s", lambda: torch.nn.functional.linear(x, layer.weight)),
    ):
        with torch.no_grad():
            fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        out[label] = statistics.median(times)
    with torch.no_grad():
        out["equal"] = bool(
            torch.equal(layer.quant_method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))
        )
    return out


def _decoded_patches(path: str):
    """The delta's entries as vLLM CheckpointWeightPatch objects (one per tensor)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    from vllm_delta.wire import read_delta

    grouped: dict[str, list] = defaultdict(list)
    for d in read_delta(path):
        if d.needs_base:
            raise ValueError("vLLM's loader needs overwrite values, not a base-relative encoding")
        grouped[d.name].append(d)
    patches = []
    for name, parts in grouped.items():
        values = torch.cat([p.values for p in parts])
        indices = torch.cat([p.positions for p in parts])
        patches.append(CheckpointWeightPatch(name, parts[0].shape, parts[0].dtype, values, indices))
    return patches


def _post_load(model, param_names) -> float:
    """vLLM's post-load steps (`quant_method.process_weights_after_loading`) of the modules owning
    `param_names`, run in place as the engine re-runs them (`commit.refresh_touched` with nothing
    built ahead: the step on the checkpoint-layout weights, its results copied into the live storage;
    the bookkeeping is about 1% of the step, benchmarks/cpu_refresh.py). Without them a CPU engine
    keeps serving its old oneDNN-packed kernels. Returns the seconds."""
    from vllm_delta.engine.commit import refresh_touched
    from vllm_delta.engine.stand_in import Prebuilt

    start = time.perf_counter()
    with torch.no_grad():
        refresh_touched(model, list(param_names), Prebuilt())
    return time.perf_counter() - start


def vllm_patch(worker, path: str, chunk_bytes: int) -> dict[str, Any]:
    """vLLM's `load_checkpoint_weight_patches` on the delta's entries, decoded beforehand, followed by
    the post-load steps of the touched modules (without them a CPU engine keeps serving old kernels)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    model = worker.model_runner.get_model()
    patches = _decoded_patches(path)
    changed = sum(p.values.numel() for p in patches)
    with PeakRss() as m:
        loaded = load_checkpoint_weight_patches(model, patches, max_chunk_bytes=chunk_bytes)
        post_load_s = _post_load(model, loaded)
    del patches
    return {
        "changed": changed,
        "payload": _payload_bytes(changed),
        "total_s": m.seconds,
        "post_load_s": post_load_s,
        "loader_s": m.seconds - post_load_s,
        "extra": m.extra,
    }


def full_load(worker, model_dir: str) -> dict[str, Any]:
    """A full `model.load_weights` of every tensor of a checkpoint, read into memory beforehand, then
    every module's post-load step."""
    from vllm_delta.wire.checkpoint import Checkpoint

    model = worker.model_runner.get_model()
    ckpt = Checkpoint.open(model_dir)
    # clone: safetensors maps the file, so the pages would otherwise be read during the load.
    tensors = [(name, t.clone()) for name, t in ckpt.iter_tensors()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    with torch.no_grad(), PeakRss() as m:
        loaded = model.load_weights(iter(tensors))
        post_load_s = _post_load(model, loaded)
    del tensors
    return {
        "total_s": m.seconds,
        "post_load_s": post_load_s,
        "loader_s": m.seconds - post_load_s,
        "extra": m.extra,
        "checkpoint_bytes": nbytes,
    }


def matches_checkpoint(worker, model_dir: str) -> dict[str, Any]:
    """Whether every checkpoint tensor, rebuilt from the weights deltas write, equals `model_dir`'s."""
    from vllm_delta.diff import int_view
    from vllm_delta.wire.checkpoint import Checkpoint

    applier = _applier(worker)
    bad, unchecked = [], []
    for name, t in Checkpoint.open(model_dir).iter_tensors():
        got = applier.rebuild(name)
        if got is None:
            unchecked.append(name)
        elif not torch.equal(int_view(got), int_view(t)):
            bad.append(name)
    return {"mismatched": bad, "unchecked": unchecked}
