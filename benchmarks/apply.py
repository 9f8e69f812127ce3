"""Apply benchmark: our two-phase in-place apply against vLLM's NaN-staged sparse loader and a
full `load_weights`, on one real vLLM CPU engine, in one run.

A random-weight Llama of about 0.5 B params (bf16 safetensors, local tokenizer) is written to a
temp dir, with deltas at several densities (perturb-style ULP steps on every tensor). One
in-process engine with delta updates on then measures, inside its worker process:

- ours: `delta_prepare`, the route's digest check and `delta_commit` (the worker extension's RPC
  methods, what the route runs), by phase, from the files on disk;
- vLLM: `load_checkpoint_weight_patches` on the same entries, decoded beforehand;
- full: `model.load_weights` of every tensor of the new checkpoint, read into memory beforehand;
- the placement probe's own time and peak memory, and one layer's packed vs unpacked CPU matmul
  (the cost of the alternative to the CPU repack).

Per method and density three samples (BASE -> NEW, NEW -> BASE, BASE -> NEW) are scored and their
median reported; an unscored reverse restores BASE. Writes docs/results/apply.md, apply_raw.json
and apply_time_vs_density.png; `--json PATH` writes the headline keys.

    .venv/bin/python benchmarks/apply.py [--layers 28] [--densities 0.005 0.02 0.05] [--out docs/results] [--json docs/results/apply.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness.perturb import perturb_tensor  # noqa: E402
from harness.tiny_models import train_tokenizer  # noqa: E402

from benchmarks import _apply_worker as W  # noqa: E402
from vllm_delta.diff import diff_param  # noqa: E402
from vllm_delta.wire import DeltaWriter, get_encoding, tensor_digest  # noqa: E402
from vllm_delta.wire.additive import partial_sum, to_hex  # noqa: E402
from vllm_delta.wire.manifest import write_manifest  # noqa: E402

# Our default --delta-updates-max-staged-bytes (the staging bound), and vLLM's chunk cap.
BOUND_BYTES = 256 << 20
MB = 1e6


# ---- inputs ------------------------------------------------------------------------------------
def llama_config(a: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=a.hidden // 16,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def shapes_of(cfg) -> dict[str, tuple[int, ...]]:
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def write_model(cfg, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    train_tokenizer(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def make_base(cfg) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in shapes_of(cfg).items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).bfloat16()
        else:
            out[name] = (0.02 * torch.randn(shape, generator=gen)).bfloat16()
        # No exact zeros: a -1 ULP step turns +-0.0 into a NaN bit pattern, which vLLM's sparse
        # loader rejects as a value (NaN is its "unchanged" sentinel). Ours would apply it exactly.
        out[name][out[name] == 0] = 2.0**-20
    return out


def make_deltas(
    base: dict[str, torch.Tensor],
    base_digests: dict[str, str],
    density: float,
    work: Path,
    encodings: list[str],
    new_dir: Path | None,
    cfg,
) -> tuple[dict[str, Path], int]:
    """Forward (v1: BASE -> NEW) and reverse (v2: NEW -> BASE) deltas per encoding."""
    gen = torch.Generator().manual_seed(int(density * 1e6))
    writers = {}
    total = sum(t.numel() for t in base.values())
    for enc in encodings:
        for direction, version in (("fwd", 1), ("rev", 2)):
            d = work / f"d{density:g}_{enc}_{direction}"
            writers[(enc, direction)] = (
                d,
                DeltaWriter(d, version=version, base_version=version - 1, encoding=enc, model_elements=total),
            )
    new_tensors = {} if new_dir is not None else None
    changed = 0
    digests: dict[tuple[str, str, str], dict[str, str]] = {}
    for name, old in base.items():
        new = perturb_tensor(old, density, gen)
        diff = diff_param(new, old)
        changed += diff.positions.numel()
        new_hash = tensor_digest(new)
        for enc in encodings:
            # What the sender publishes (sender/publisher.py): the post-apply digest of the changed
            # positions, and the pre-apply one on base-relative encodings only.
            base_rel = get_encoding(enc).needs_base
            for direction, before, after in (
                ("fwd", diff.old_values, diff.new_values),
                ("rev", diff.new_values, diff.old_values),
            ):
                digests[(enc, name, direction)] = {
                    "post_digest": to_hex(partial_sum(diff.positions, after)),
                    **({"pre_digest": to_hex(partial_sum(diff.positions, before))} if base_rel else {}),
                }
            writers[(enc, "fwd")][1].add(
                name, diff.positions, diff.new_values, diff.old_values, shape=old.shape, post_hash=new_hash
            )
            writers[(enc, "rev")][1].add(
                name,
                diff.positions,
                diff.old_values,
                diff.new_values,
                shape=old.shape,
                post_hash=base_digests[name],
            )
        if new_tensors is not None:
            new_tensors[name] = new
    for (enc, direction), (d, w) in writers.items():
        m = w.manifest()
        write_manifest(
            d,
            m.model_copy(
                update={"params": [p.model_copy(update=digests[(enc, p.name, direction)]) for p in m.params]}
            ),
        )
    if new_tensors is not None:
        write_model(cfg, new_dir, new_tensors)
    return {f"{enc}_{direction}": d for (enc, direction), (d, _) in writers.items()}, changed


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.suffix == ".safetensors")


def other_engines() -> int:
    """vLLM engine-core processes already running on this machine (other users of the 2 cores)."""
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                n += b"EngineCore" in (p / "cmdline").read_bytes()
            except OSError:
                pass
    return n


# ---- engine ------------------------------------------------------------------------------------
def rpc(llm, fn, *args):
    return llm.collective_rpc(fn, args=args)[0]


def run_engine(base_dir: Path, new_dir: Path, deltas: dict[float, dict[str, Path]], a) -> dict:
    """Every measured call starts from BASE or NEW, alternating: samples are fwd, rev, fwd, then an
    unscored reverse ("restore") brings the engine back to BASE for the next density."""
    from harness.vllm_engine import start_llm

    # The worker must import benchmarks._apply_worker (collective_rpc pickles the function by name).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    res: dict = {
        "runs": [],
        "load_before": os.getloadavg(),
        "other_engines": other_engines(),
        "other_processes": busy_processes(),
    }
    t0 = time.perf_counter()
    with start_llm(base_dir, delta=True) as llm:
        res["engine_start_s"] = time.perf_counter() - t0
        res["info"] = rpc(llm, W.info)
        print(
            f"engine up in {res['engine_start_s']:.0f}s; worker torch threads {res['info']['torch_threads']}, "
            f"stashed (repacked elsewhere) {res['info']['stashed']}",
            flush=True,
        )
        res["placement"] = rpc(llm, W.learn_placement)
        print(
            f"placement probe: {res['placement']['probe_s']:.2f}s, +{res['placement']['probe_peak_bytes'] / MB:.0f} MB "
            f"peak, fallback {res['placement']['fallback']}",
            flush=True,
        )
        res["gemm"] = [rpc(llm, W.gemm_paths, b) for b in (1, 64)]

        def step(method, density, direction, fn, *args):
            r = rpc(llm, fn, *args)
            r.update(method=method, density=density, direction=direction)
            res["runs"].append(r)
            print(
                f"  {method:>14} {density:>6.1%} {direction:>8}: {r['total_s']:.3f}s, extra {r['extra'] / MB:.0f} MB"
                + (
                    f"  [prepare {r['prepare_s']:.3f} digest {r['digest_s']:.3f} scatter {r['scatter_s']:.3f} "
                    f"repack {r['repack_s']:.3f}]"
                    if "scatter_s" in r
                    else ""
                ),
                flush=True,
            )

        def three(method, density, fn, fwd, rev, *args):
            for direction, src in (("fwd", fwd), ("rev", rev), ("fwd", fwd), ("restore", rev)):
                step(method, density, direction, fn, *(src if isinstance(src, tuple) else (src,)), *args)

        enc = a.encoding
        d0 = min(deltas)
        print("warm-up (first calls, unscored):", flush=True)
        step("ours", d0, "warm", W.ours, str(deltas[d0][f"{enc}_fwd"]), 1, BOUND_BYTES)
        step("ours", d0, "warm", W.ours, str(deltas[d0][f"{enc}_rev"]), 2, BOUND_BYTES)
        step("vllm", d0, "warm", W.vllm_patch, str(deltas[d0][f"{enc}_fwd"]), BOUND_BYTES)
        step("vllm", d0, "warm", W.vllm_patch, str(deltas[d0][f"{enc}_rev"]), BOUND_BYTES)
        print("measured:", flush=True)
        for density in sorted(deltas):
            paths = deltas[density]
            for e in [enc, *a.extra_encodings]:
                three(
                    "ours" if e == enc else f"ours:{e}",
                    density,
                    W.ours,
                    (str(paths[f"{e}_fwd"]), 1),
                    (str(paths[f"{e}_rev"]), 2),
                    BOUND_BYTES,
                )
            three(
                "vllm", density, W.vllm_patch, str(paths[f"{enc}_fwd"]), str(paths[f"{enc}_rev"]), BOUND_BYTES
            )
        three("full", a.full_density, W.full_load, str(new_dir), str(base_dir))
        res["load_after"] = os.getloadavg()
        res["final_check"] = rpc(llm, W.matches_checkpoint, str(base_dir))
        print(
            f"final state equals BASE: mismatched {res['final_check']['mismatched']}, "
            f"unchecked {res['final_check']['unchecked']}",
            flush=True,
        )
    return res


# ---- report ------------------------------------------------------------------------------------
def machine() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        )
    except StopIteration:
        model = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB RAM"


def busy_processes() -> list[str]:
    """Other processes using CPU right now (over 10% over 1 s): what shared the cores."""

    def ticks() -> dict[int, tuple[int, str]]:
        out = {}
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) != os.getpid():
                try:
                    f = (p / "stat").read_text().rsplit(")", 1)[1].split()
                    cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    out[int(p.name)] = (int(f[11]) + int(f[12]), cmd[:120])
                except (OSError, IndexError, ValueError):
                    pass
        return out

    before = ticks()
    time.sleep(1.0)
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    return [
        f"{(t - before[pid][0]) / hz:.0%} {cmd}"
        for pid, (t, cmd) in after.items()
        if pid in before and (t - before[pid][0]) / hz > 0.1
    ]


def samples(res: dict, method: str, density: float) -> list[dict]:
    return [
        r
        for r in res["runs"]
        if r["method"] == method and r["density"] == density and r["direction"] in ("fwd", "rev")
    ]


def med(res: dict, method: str, density: float, key: str) -> float:
    return statistics.median(r[key] for r in samples(res, method, density))


def summary(res: dict, a) -> dict[str, float]:
    """The keys `--json` writes (medians of 3 samples, one run)."""
    full = med(res, "full", a.full_density, "total_s")
    full_loader = med(res, "full", a.full_density, "loader_s")
    out = {}
    for d in sorted({r["density"] for r in res["runs"] if r["method"] == "ours"}):
        ours, vllm = med(res, "ours", d, "total_s"), med(res, "vllm", d, "total_s")
        key = f"{d * 100:g}pct".replace(".", "p")
        out[f"vs_vllm_{key}"] = vllm / ours
        ours_no_repack = ours - med(res, "ours", d, "repack_s")
        # Fair both ways: the post-load steps (the CPU repack) in both arms, or excluded from both.
        out[f"vs_vllm_no_repack_{key}"] = med(res, "vllm", d, "loader_s") / ours_no_repack
        out[f"vs_full_{key}"] = full / ours
        out[f"vs_full_no_repack_{key}"] = full_loader / ours_no_repack
        out[f"mem_over_payload_{key}"] = med(res, "ours", d, "extra") / med(res, "ours", d, "payload")
        # Less what exists only because of the CPU repack (none on a GPU): `extra_no_repack`.
        out[f"mem_no_repack_over_payload_{key}"] = med(res, "ours", d, "extra_no_repack") / med(
            res, "ours", d, "payload"
        )
    out["probe_s"] = res["placement"]["probe_s"]
    out["probe_peak_bytes"] = res["placement"]["probe_peak_bytes"]
    return out


def write_report(out: Path, res: dict, a, facts: dict, keys: dict[str, float]) -> list[str]:
    import vllm

    enc = a.encoding
    densities = sorted(facts["deltas"])
    full_s = med(res, "full", a.full_density, "total_s")
    pl = res["placement"]
    lines = [
        "# Apply benchmark: in-place delta apply vs vLLM's sparse loader vs a full reload",
        "",
        f"Generated by `{facts['command']}` in {facts['wall_s']:.0f} s, one run, one engine.",
        "",
        f"- **Machine:** {machine()}, shared with other agents; this run pinned to core(s) "
        f"{sorted(os.sched_getaffinity(0))} (`taskset`) and serialized with other engine runs (`flock`). "
        "The engine's worker runs torch with "
        f"{res['info']['torch_threads']} thread. Python {platform.python_version()}, torch {torch.__version__}, "
        f"vLLM {vllm.__version__}. Load average at engine start {res['load_before'][0]:.1f}, at the end "
        f"{res['load_after'][0]:.1f}; {res['other_engines']} other vLLM engine process(es) at the start. "
        "Other processes busy (>10% of a core over 1 s) just before the engine started: "
        + ("; ".join(f"`{p}`" for p in res["other_processes"]) or "none")
        + ".",
        f"- **Model:** random-weight Llama, {facts['params'] / 1e9:.3f} B params in {facts['tensors']} bf16 "
        f"tensors ({facts['params'] * 2 / 2**30:.2f} GiB): hidden {a.hidden}, intermediate {a.intermediate}, "
        f"{a.layers} layers, vocab 32000, untied lm_head. One in-process engine "
        "(`tests/harness/vllm_engine.start_llm(..., delta=True)`, TP=1, eager).",
        f"- **Deltas:** every tensor perturbed like `tests/harness/perturb.py`, written with the wire writer in "
        f"`{enc}` (overwrite values, so all three methods see the same entries), block-indexed flushes "
        "(`vllm-delta/2`, docs/wire-format.md; at TP=1 every block is decoded), with the additive digests the "
        "sender publishes (`post_digest` of the changed positions; `pre_digest` too on base-relative "
        "encodings). Forward = BASE -> NEW (version 1), reverse = NEW -> BASE (version 2).",
        "- **Samples:** per method and density, fwd, rev, fwd are scored (median reported), then an unscored "
        "reverse restores BASE. A warm-up pair of each sparse method runs first, unscored.",
        "- **Payload** = decoded positions (int64) + values (bf16) = 10 B per changed element.",
        "- **Memory** = peak extra RSS of the worker process during the call (VmHWM reset via "
        "`/proc/self/clear_refs` just before; baseline = RSS then, after `gc.collect()` + `malloc_trim`).",
        f"- **Bounds:** {BOUND_BYTES >> 20} MiB: ours bounds the whole staged update with it "
        "(`--delta-updates-max-staged-bytes`), vLLM's loader its chunks.",
        "",
        "## What is timed",
        "",
        "- **ours**: what the route runs, from the files on disk: `delta_prepare` (read, xxh3 file check, "
        "decode, locate each entry's storage offset, this rank's additive digests of the changed positions, "
        "staging), the route's digest check (`check_partials`), then `delta_commit` (scatter into the live "
        "weights; on CPU vLLM's oneDNN repack of every touched linear layer is built in prepare while serving "
        "and swapped in by the commit). *stage* = decode + locate + digests + staging; *digest* is its digest "
        "part; *repack* = the repack built in prepare (`prebuild`) + the commit's swap and re-runs "
        "(`post_load`); *scatter* = commit - `post_load` (the scatters, the read-back of every written offset "
        "from the live weights, and a device synchronize).",
        "- **vLLM**: `load_checkpoint_weight_patches(model, patches, max_chunk_bytes)`, one "
        "`CheckpointWeightPatch` per tensor, decoded before the clock starts. It stages each patched tensor "
        "at full shape filled with NaN and replays `model.load_weights`; then vLLM's post-load step "
        "(`process_weights_after_loading`, the CPU repack) of every touched module, run in place, without which "
        "the engine would keep serving the old packed kernels. *loader* is the arm without that step.",
        "- **full**: `model.load_weights` of every tensor of the checkpoint, already in memory, then every "
        "module's post-load step.",
        "- **Fair ratios:** every arm leaves the engine serving the new weights. The ratios are given twice: with "
        "the post-load steps (the CPU repack) in both arms, and with them excluded from both.",
        "",
        f"**Placement probe** (once, at engine start; not in any apply time): {pl['probe_s']:.2f} s, "
        f"+{pl['probe_peak_bytes'] / MB:.0f} MB peak RSS ({pl['tensors']} tensors, "
        f"{len(pl['fallback'] or {})} fall back to vLLM's loader). Final state compared with BASE: "
        f"{len(res['final_check']['mismatched'])} tensors mismatched, {len(res['final_check']['unchecked'])} unchecked.",
        "",
        "## Results (medians of 3)",
        "",
        "| density | changed | payload | wire | ours total | prepare | of it stage (digest) | scatter | CPU repack "
        "| vLLM loader + post-load (loader) | full load_weights + post-load | ours extra mem | vLLM extra mem |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in densities:
        m = {
            k: med(res, "ours", d, k)
            for k in (
                "changed",
                "payload",
                "bytes_read",
                "total_s",
                "prepare_s",
                "stage_s",
                "digest_s",
                "scatter_s",
                "repack_s",
                "extra",
            )
        }
        v_s, v_mem = med(res, "vllm", d, "total_s"), med(res, "vllm", d, "extra")
        v_loader = med(res, "vllm", d, "loader_s")
        lines.append(
            f"| {d:.1%} | {m['changed'] / 1e6:.2f} M | {m['payload'] / MB:.0f} MB | {m['bytes_read'] / MB:.0f} MB "
            f"| **{m['total_s']:.3f} s** | {m['prepare_s']:.3f} s | {m['stage_s']:.3f} s ({m['digest_s']:.3f}) "
            f"| {m['scatter_s']:.3f} s | {m['repack_s']:.3f} s | {v_s:.3f} s ({v_loader:.3f} s) | {full_s:.3f} s "
            f"| {m['extra'] / MB:.0f} MB ({m['extra'] / m['payload']:.2f}x) | {v_mem / MB:.0f} MB "
            f"({v_mem / m['payload']:.2f}x) |"
        )
    lines += [
        "",
        "| density | vLLM / ours | vLLM / ours, repack excluded from both | full / ours "
        "| full / ours, repack excluded from both | ours extra mem / payload | the same less the CPU repack |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in densities:
        k = f"{d * 100:g}pct".replace(".", "p")
        lines.append(
            f"| {d:.1%} | {keys[f'vs_vllm_{k}']:.1f}x | {keys[f'vs_vllm_no_repack_{k}']:.1f}x "
            f"| {keys[f'vs_full_{k}']:.2f}x | {keys[f'vs_full_no_repack_{k}']:.2f}x "
            f"| {keys[f'mem_over_payload_{k}']:.2f}x | {keys[f'mem_no_repack_over_payload_{k}']:.2f}x |"
        )
    lines += ["", "### Targets", ""]
    for d, key, goal in ((0.02, "2pct", 10), (0.005, "0p5pct", 30)):
        if f"vs_vllm_{key}" in keys:
            r, r2 = keys[f"vs_vllm_{key}"], keys[f"vs_vllm_no_repack_{key}"]
            lines.append(
                f"- **>= {goal}x vLLM's loader at {d:.1%}:** {'met' if r >= goal else 'NOT met'} end to end "
                f"({r:.1f}x); with the CPU repack excluded from both arms {r2:.1f}x "
                f"({'met' if r2 >= goal else 'NOT met'})."
            )
    if "mem_over_payload_2pct" in keys:
        m = keys["mem_over_payload_2pct"]
        m2 = keys["mem_no_repack_over_payload_2pct"]
        lines.append(
            f"- **Extra memory <= 2x payload at 2%:** {'met' if m <= 2 else 'NOT met'} ({m:.2f}x); less what "
            f"exists only because of the CPU repack (its packed copies built ahead, held to the commit, and the "
            f"weight copies they are built from, one unit's at a time; none on a GPU) {m2:.2f}x "
            f"({'met' if m2 <= 2 else 'NOT met'})."
        )
    g1, g64 = res["gemm"]
    gemm = (
        f"Its cost is generation speed, measured on `{g1['layer']}` ({g1['shape']}), median of 20 calls: batch 1: "
        f"packed {g1['packed_s'] * 1e3:.2f} ms, unpacked {g1['unpacked_s'] * 1e3:.2f} ms "
        f"({g1['unpacked_s'] / g1['packed_s']:.2f}x); batch 64: packed {g64['packed_s'] * 1e3:.2f} ms, unpacked "
        f"{g64['unpacked_s'] * 1e3:.2f} ms ({g64['unpacked_s'] / g64['packed_s']:.2f}x). Outputs bit-equal: "
        f"{g1['equal']} / {g64['equal']}."
        if "error" not in g1 and "error" not in g64
        else f"The matmul comparison failed: {g1.get('error') or g64.get('error')}."
    )
    lines += [
        "",
        "## Where our time goes, and the alternative to a CPU repack",
        "",
        facts["analysis"],
        "",
        "Alternative: serve the updated layers from vLLM's unpacked path (plain `F.linear` on the checkpoint "
        "layout), so no repack is needed. " + gemm,
        "",
        "## All samples",
        "",
        "| method | density | direction | time | extra mem |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r['method']} | {r['density']:.1%} | {r['direction']} | {r['total_s']:.3f} s | {r['extra'] / MB:.0f} MB |"
        for r in res["runs"]
    ]
    lines += [
        "",
        "Rows `ours:<encoding>` apply the same changes in another encoding (`ulp_zstd` is "
        "base-relative: vLLM's loader cannot take it).",
        "",
        "## Reproduce",
        "",
        "```",
        facts["command"],
        "```",
        "",
        f"Raw numbers: `{out.name.replace('.md', '_raw.json')}`; headline keys: `--json`.",
        "",
    ]
    out.write_text("\n".join(lines))
    return [f"{k}: {v:.3g}" for k, v in keys.items()]


def analysis(res: dict, a) -> str:
    """Where our time goes at `--full-density`, from the measured numbers only."""
    d = a.full_density
    o = {
        k: med(res, "ours", d, k)
        for k in (
            "total_s",
            "prepare_s",
            "stage_s",
            "digest_s",
            "scatter_s",
            "repack_s",
            "changed",
            "staged",
            "prebuilt_bytes",
            "stage_extra",
            "prepare_extra",
            "commit_extra",
        )
    }
    v = med(res, "vllm", d, "total_s")
    budget = v / 10
    repacked = len(res["info"]["stashed"]) + res["info"]["restored"]
    ns = lambda s: s / o["changed"] * 1e9  # noqa: E731
    return (
        f"At {d:.0%}, vLLM's loader took {v:.2f} s, so 10x asks for {budget:.3f} s end to end: "
        f"{ns(budget):.0f} ns per changed entry ({o['changed'] / 1e6:.1f} M) on one thread, for read, decode, "
        f"locate, digests and scatter. We took {o['total_s']:.2f} s ({ns(o['total_s']):.0f} ns per entry): "
        f"prepare {o['prepare_s']:.2f} s, of which the additive digests of the changed positions "
        f"{o['digest_s']:.2f} s ({ns(o['digest_s']):.0f} ns per entry) and decode + locate + staging "
        f"{o['stage_s'] - o['digest_s']:.2f} s; scatter {o['scatter_s']:.2f} s; CPU repack {o['repack_s']:.2f} s. "
        f"On this machine vLLM's post-load step repacked {repacked} parameters (see the matmul comparison below), "
        f"so the CPU repack is {'not ' if o['repack_s'] < 0.1 * o['total_s'] else ''}what misses the target; "
        f"without the digests we would have taken {o['total_s'] - o['digest_s']:.2f} s "
        f"({v / (o['total_s'] - o['digest_s']):.1f}x vLLM's loader). A full `load_weights` of in-memory tensors "
        f"took {med(res, 'full', d, 'total_s'):.2f} s: on a 1 GB model one pass over the weights is cheap. "
        f"Memory over the RSS before prepare: the staged chunks ({o['staged'] / MB:.0f} MB) and the packed "
        f"copies of the CPU repack built ahead ({o['prebuilt_bytes'] / MB:.0f} MB) are held from prepare to "
        f"commit; prepare peaked at {o['stage_extra'] / MB:.0f} MB before the repack (the flushes' bytes, a "
        f"batch of decoded changes with its located offsets, the digest temporaries, on top of the staged "
        f"chunks) and at {o['prepare_extra'] / MB:.0f} MB with it (its packed copies and one unit's weight "
        f"copy it is built from), commit at {o['commit_extra'] / MB:.0f} MB (staged chunks are freed as they "
        f"are scattered, the old packed copies as the new ones are swapped in)."
    )


def plot(path: Path, res: dict, densities: list[float], a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [d * 100 for d in densities]
    ax.plot(xs, [med(res, "ours", d, "total_s") for d in densities], "o-", label="ours (end to end)")
    ax.plot(
        xs,
        [med(res, "ours", d, "total_s") - med(res, "ours", d, "repack_s") for d in densities],
        "o--",
        label="ours without CPU repack",
    )
    ax.plot(
        xs,
        [med(res, "vllm", d, "total_s") for d in densities],
        "s-",
        label="vLLM load_checkpoint_weight_patches",
    )
    ax.axhline(med(res, "full", a.full_density, "total_s"), color="gray", ls=":", label="full load_weights")
    ax.set_yscale("log")
    ax.set_xlabel("density (% of elements changed)")
    ax.set_ylabel("seconds (log), median of 3")
    ax.set_title("Apply time, 0.5 B Llama, 1 CPU thread")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.02, 0.05])
    p.add_argument("--encoding", default="deltas_zstd")
    p.add_argument("--extra-encodings", nargs="*", default=["ulp_zstd"])
    p.add_argument("--full-density", type=float, default=0.02, help="which NEW the full reload loads")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--json", type=Path, help="write the headline keys (vs_vllm_2pct, ...) here")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    a = p.parse_args()
    if a.full_density not in a.densities:
        p.error("--full-density must be one of --densities")

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="apply-bench-"))
    try:
        cfg = llama_config(a)
        base = make_base(cfg)
        params = sum(t.numel() for t in base.values())
        print(f"model: {params / 1e9:.3f} B params, {len(base)} tensors", flush=True)
        base_dir, new_dir = work / "base", work / "new"
        write_model(cfg, base_dir, base)
        base_digests = {n: tensor_digest(t) for n, t in base.items()}
        deltas = {}
        for d in a.densities:
            t = time.perf_counter()
            deltas[d], changed = make_deltas(
                base,
                base_digests,
                d,
                work,
                [a.encoding, *a.extra_encodings],
                new_dir if d == a.full_density else None,
                cfg,
            )
            print(
                f"deltas at {d:.1%}: {changed / 1e6:.2f} M changed, {a.encoding} "
                f"{dir_bytes(deltas[d][a.encoding + '_fwd']) / MB:.0f} MB ({time.perf_counter() - t:.0f}s)",
                flush=True,
            )
        del base
        gc.collect()
        res = run_engine(base_dir, new_dir, deltas, a)
        keys = summary(res, a)
        facts = {
            "params": params,
            "tensors": len(base_digests),
            "deltas": deltas,
            "wall_s": time.perf_counter() - start,
            "analysis": analysis(res, a),
            "command": " ".join([".venv/bin/python", "benchmarks/apply.py", *sys.argv[1:]]),
        }
        a.out.mkdir(parents=True, exist_ok=True)
        lines = write_report(a.out / "apply.md", res, a, facts, keys)
        (a.out / "apply_raw.json").write_text(json.dumps(res, indent=1, default=str))
        if a.json:
            a.json.write_text(json.dumps(keys, indent=1))
        plot(a.out / "apply_time_vs_density.png", res, sorted(deltas), a)
        print("\n".join(lines))
        print(f"wrote {a.out / 'apply.md'} in {time.perf_counter() - start:.0f}s")
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
