"""Apply benchmark: our two-phase in-place apply against vLLM's NaN-staged sparse loader and a
full `load_weights`, on one real vLLM CPU engine, in one run.

A random-weight Llama of about 0.5 B params (bf16 safetensors, local tokenizer) is written to a
temp dir, with deltas at several densities (perturb-style ULP steps on every tensor). One
in-process engine with delta updates on then measures, inside its worker process:

- ours: `delta_prepare` + `delta_commit` (the worker extension's RPC methods), by phase;
- vLLM: `load_checkpoint_weight_patches` on the same entries, decoded beforehand;
- full: `model.load_weights` of every tensor of the new checkpoint, read into memory beforehand.

Every measured apply starts from BASE: each forward apply (BASE -> NEW) is followed by the same
method's reverse apply (NEW -> BASE), which is measured too. Writes docs/results/apply.md and
docs/results/apply_time_vs_density.png.

    .venv/bin/python benchmarks/apply.py [--layers 28] [--densities 0.005 0.02 0.05] [--out docs/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks import _apply_worker as W  # noqa: E402
from harness.perturb import perturb_tensor  # noqa: E402
from harness.tiny_models import train_tokenizer  # noqa: E402
from vllm_delta.diff import diff_param  # noqa: E402
from vllm_delta.wire import DeltaWriter, tensor_digest  # noqa: E402

CHUNK_BYTES = 256 << 20  # both sparse paths: our default --delta-updates-chunk-bytes
MB = 1e6


# ---- inputs ------------------------------------------------------------------------------------
def llama_config(a: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=8, head_dim=a.hidden // 16,
        max_position_embeddings=512, torch_dtype="bfloat16", tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def shapes_of(cfg) -> dict[str, tuple[int, ...]]:
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
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
        out[name][out[name] == 0] = 2.0 ** -20
    return out


def make_deltas(base: dict[str, torch.Tensor], base_digests: dict[str, str], density: float, work: Path,
                encodings: list[str], new_dir: Path | None, cfg) -> tuple[dict[str, Path], int]:
    """Forward (v1: BASE -> NEW) and reverse (v2: NEW -> BASE) deltas per encoding."""
    gen = torch.Generator().manual_seed(int(density * 1e6))
    writers = {}
    total = sum(t.numel() for t in base.values())
    for enc in encodings:
        for direction, version in (("fwd", 1), ("rev", 2)):
            d = work / f"d{density:g}_{enc}_{direction}"
            writers[(enc, direction)] = (d, DeltaWriter(d, version=version, base_version=version - 1,
                                                        encoding=enc, model_elements=total))
    new_tensors = {} if new_dir is not None else None
    changed = 0
    for name, old in base.items():
        new = perturb_tensor(old, density, gen)
        diff = diff_param(new, old)
        changed += diff.count
        new_hash = tensor_digest(new)
        for enc in encodings:
            writers[(enc, "fwd")][1].add(name, diff.positions, diff.new_values, diff.old_values,
                                         shape=old.shape, post_hash=new_hash)
            writers[(enc, "rev")][1].add(name, diff.positions, diff.old_values, diff.new_values,
                                         shape=old.shape, post_hash=base_digests[name])
        if new_tensors is not None:
            new_tensors[name] = new
    for _, w in writers.values():
        w.close()
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
    from harness.vllm_engine import start_llm

    # The worker must import benchmarks._apply_worker (collective_rpc pickles the function by name).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    res: dict = {"runs": [], "load_before": os.getloadavg(), "other_engines": other_engines()}
    t0 = time.perf_counter()
    with start_llm(base_dir, delta=True) as llm:
        res["engine_start_s"] = time.perf_counter() - t0
        res["info"] = rpc(llm, W.info)
        print(f"engine up in {res['engine_start_s']:.0f}s; worker torch threads {res['info']['torch_threads']}, "
              f"stashed (repacked elsewhere) {res['info']['stashed']}", flush=True)
        res["placement"] = rpc(llm, W.learn_placement)
        print(f"placement learned once: {res['placement']['seconds']:.2f}s, "
              f"+{res['placement']['extra'] / MB:.0f} MB, fallback {res['placement']['fallback']}", flush=True)

        def step(method, density, direction, fn, *args):
            r = rpc(llm, fn, *args)
            r.update(method=method, density=density, direction=direction)
            res["runs"].append(r)
            print(f"  {method:>10} {density:>6.1%} {direction}: {r['total_s']:.3f}s, "
                  f"extra {r['extra'] / MB:.0f} MB" + (f" (payload {r['payload'] / MB:.0f} MB)" if "payload" in r else "")
                  + (f"  [decode {r['decode_s']:.3f} locate {r['locate_s']:.3f} scatter {r['scatter_s']:.3f} "
                     f"repack {r['repack_s']:.3f} verify {r['verify_s']:.3f}]" if "scatter_s" in r else ""),
                  flush=True)
            return r

        enc = a.encoding
        # Warm-up round at the smallest density: the first call of each path pays one-time costs.
        d0 = min(deltas)
        print("warm-up (first calls):", flush=True)
        step("ours", d0, "first", W.ours, str(deltas[d0][f"{enc}_fwd"]), 1, CHUNK_BYTES)
        step("ours", d0, "first-rev", W.ours, str(deltas[d0][f"{enc}_rev"]), 2, CHUNK_BYTES)
        step("vllm", d0, "first", W.vllm_patch, str(deltas[d0][f"{enc}_fwd"]), CHUNK_BYTES)
        step("vllm", d0, "first-rev", W.vllm_patch, str(deltas[d0][f"{enc}_rev"]), CHUNK_BYTES)
        print("measured:", flush=True)
        for density in sorted(deltas):
            paths = deltas[density]
            step("ours", density, "fwd", W.ours, str(paths[f"{enc}_fwd"]), 1, CHUNK_BYTES)
            step("ours", density, "rev", W.ours, str(paths[f"{enc}_rev"]), 2, CHUNK_BYTES)
            for extra in a.extra_encodings:
                step(f"ours:{extra}", density, "fwd", W.ours, str(paths[f"{extra}_fwd"]), 1, CHUNK_BYTES)
                step(f"ours:{extra}", density, "rev", W.ours, str(paths[f"{extra}_rev"]), 2, CHUNK_BYTES)
            step("vllm", density, "fwd", W.vllm_patch, str(paths[f"{enc}_fwd"]), CHUNK_BYTES)
            step("vllm", density, "rev", W.vllm_patch, str(paths[f"{enc}_rev"]), CHUNK_BYTES)
        if not a.no_profile:  # an extra, unreported-in-the-table pair with cProfile on
            paths = deltas[a.full_density]
            step("ours", a.full_density, "profiled", W.ours, str(paths[f"{enc}_fwd"]), 1, CHUNK_BYTES, True)
            step("ours", a.full_density, "profiled-rev", W.ours, str(paths[f"{enc}_rev"]), 2, CHUNK_BYTES)
        step("full", a.full_density, "fwd", W.full_load, str(new_dir))
        step("full", a.full_density, "rev", W.full_load, str(base_dir))
        res["load_after"] = os.getloadavg()
        res["final_check"] = rpc(llm, W.matches_checkpoint, str(base_dir))
        print(f"final state equals BASE: mismatched {res['final_check']['mismatched']}, "
              f"unchecked {res['final_check']['unchecked']}", flush=True)
    return res


# ---- report ------------------------------------------------------------------------------------
def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except StopIteration:
        model = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB RAM"


def pick(res, method, density, direction="fwd"):
    return next(r for r in res["runs"] if r["method"] == method and r["density"] == density
                and r["direction"] == direction)


def write_report(out: Path, res: dict, a, facts: dict) -> list[str]:
    import vllm

    enc = a.encoding
    densities = sorted(facts["deltas"])
    full = pick(res, "full", a.full_density)
    full_rev = pick(res, "full", a.full_density, "rev")
    lines = [
        "# Apply benchmark: in-place delta apply vs vLLM's sparse loader vs a full reload",
        "",
        f"Generated by `.venv/bin/python benchmarks/apply.py` in {facts['wall_s']:.0f} s.",
        "",
        f"- **Machine:** {machine()}, shared with other work; the engine's worker runs torch with "
        f"{res['info']['torch_threads']} thread (vLLM's CPU OpenMP binding at TP=1 keeps one core for the "
        f"front end). Python {platform.python_version()}, torch {torch.__version__}, vLLM {vllm.__version__}.",
        f"- **Model:** random-weight Llama, {facts['params'] / 1e9:.3f} B params in {facts['tensors']} bf16 "
        f"tensors ({facts['params'] * 2 / 2**30:.2f} GiB): hidden {a.hidden}, intermediate {a.intermediate}, "
        f"{a.layers} layers, 16 heads / 8 KV heads of dim {a.hidden // 16}, vocab 32000, untied lm_head. "
        f"Load average when the engine started: {res['load_before'][0]:.1f}, before the final check: "
        f"{res['load_after'][0]:.1f} ({res['other_engines']} other vLLM engine(s) running at the start). "
        "One in-process engine (`tests/harness/vllm_engine.start_llm(..., delta=True)`, TP=1, eager).",
        f"- **Deltas:** every tensor perturbed like `tests/harness/perturb.py` (about the given fraction of "
        "elements moved by +-1..2 ULP, 10% of them by up to 80 ULP; BASE has no exact zeros, so no step makes a NaN, which vLLM's loader refuses as a value), written with the wire writer in "
        f"`{enc}` (an overwrite encoding, so all three methods see the same entries), with post-apply hashes "
        "as `vllm-delta diff` writes them. Forward = BASE -> NEW (version 1), reverse = NEW -> BASE "
        "(version 2).",
        "- **Payload** = decoded positions (int64) + values (bf16) = 10 B per changed element.",
        f"- **Memory** = peak extra RSS of the worker process during the call: VmHWM is reset via "
        "`/proc/self/clear_refs` just before, so the peak is exact; the baseline is the RSS at that "
        "moment (after `gc.collect()` + `malloc_trim`), with everything prepared in advance already resident.",
        f"- **Chunk cap:** {CHUNK_BYTES >> 20} MiB for both sparse paths (our `--delta-updates-chunk-bytes` "
        "default, vLLM's `max_chunk_bytes`).",
        "",
        "## What each method does and what is timed",
        "",
        "- **ours**: the worker extension's `delta_prepare` (read + hash-check + decode the files, locate "
        "each entry's storage offset through the learned placement) then `delta_commit` (scatter into the "
        "live weights, re-run vLLM's CPU post-load repack for touched layers, verify post-apply hashes). "
        "The whole thing is timed from the files on disk. Phases: *decode* = all of `delta_prepare` "
        "(*locate* is the part of it spent mapping positions to storage offsets); *scatter* = the "
        "`index_put_` writes; *repack* = CPU-only re-run of oneDNN packing for touched layers (not needed "
        "on CUDA); *verify* = rebuilding every touched tensor and checking its xxh3 post-hash.",
        "- **vLLM**: `vllm.model_executor.model_loader.checkpoint_weight_patch.load_checkpoint_weight_patches"
        "(model, patches, max_chunk_bytes)` with one `CheckpointWeightPatch(name, shape, dtype, values, "
        "indices)` per tensor. The delta is decoded before the clock starts, so only the loader is timed. "
        "It stages each patched tensor at full shape filled with NaN and replays `model.load_weights`.",
        "- **full**: `model.load_weights` over every tensor of the NEW checkpoint, already in memory.",
        "",
        "vLLM's loader and the full reload write the live parameters through the model's loaders but do "
        "**not** refresh the CPU-packed kernels (oneDNN keeps its own copy of each linear weight), so after "
        "them the engine would still compute with the old weights. That is fine for timing, and no "
        "generation is run after them. Ours includes that refresh (*repack*); the ratios below are given "
        "with and without it.",
        "",
        "**Every measured apply starts from BASE.** Each method restores BASE itself: ours applies the "
        "reverse delta (its post-hash check proves the result is bit-exact BASE), vLLM's loader applies the "
        "reverse patches, and the full reload loads BASE after NEW. Because the vLLM and full paths write "
        "only the live (canonical) tensors and leave the packed kernels as they were built from BASE, "
        "after their reverse step live weights and kernels agree on BASE again. "
        f"At the end every checkpoint tensor, read back from the engine, is compared with BASE: "
        f"{len(res['final_check']['mismatched'])} mismatched, {len(res['final_check']['unchecked'])} unchecked. "
        "Reverse applies are measured as a second sample.",
        "",
        f"**One-time placement learning** (first apply only, excluded below): "
        f"{res['placement']['seconds']:.2f} s, +{res['placement']['extra'] / MB:.0f} MB peak; "
        f"{res['placement']['tensors']} tensors, {len(res['placement']['fallback'])} fall back to vLLM's loader.",
        "",
        "## Results",
        "",
        "| density | changed | payload | wire bytes | ours total | decode (locate) | scatter | repack | verify "
        "| vLLM loader | full load_weights | ours extra mem | vLLM extra mem | full extra mem |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for d in densities:
        o, v = pick(res, "ours", d), pick(res, "vllm", d)
        lines.append(
            f"| {d:.1%} | {o['changed'] / 1e6:.2f} M | {o['payload'] / MB:.0f} MB | {o['bytes_read'] / MB:.0f} MB "
            f"| **{o['total_s']:.3f} s** | {o['prepare_s']:.3f} s ({o['locate_s']:.3f}) | {o['scatter_s']:.3f} s "
            f"| {o['repack_s']:.3f} s | {o['verify_s']:.3f} s | {v['total_s']:.3f} s | {full['total_s']:.3f} s "
            f"| {o['extra'] / MB:.0f} MB ({o['extra'] / o['payload']:.2f}x) "
            f"| {v['extra'] / MB:.0f} MB ({v['extra'] / v['payload']:.2f}x) | {full['extra'] / MB:.0f} MB |")
        no_repack = o["total_s"] - o["repack_s"]
        ratios.append((d, v["total_s"] / o["total_s"], v["total_s"] / no_repack,
                       v["total_s"] / (o["commit_s"] - o["repack_s"]), full["total_s"] / o["total_s"],
                       o["extra"] / o["payload"]))
    lines += [
        "",
        f"The full reload does not depend on density; it was measured once (loading NEW at "
        f"{a.full_density:.0%}: {full['total_s']:.3f} s; loading BASE back: {full_rev['total_s']:.3f} s).",
        "",
        "### Ratios (same run)",
        "",
        "| density | vLLM / ours (end to end) | vLLM / ours without CPU repack | vLLM / ours commit without repack "
        "| full / ours (end to end) | ours extra mem / payload |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r1, r2, r3, r4, m in ratios:
        lines.append(f"| {d:.1%} | {r1:.1f}x | {r2:.1f}x | {r3:.1f}x | {r4:.1f}x | {m:.2f}x |")
    two = next((r for r in ratios if abs(r[0] - 0.02) < 1e-9), ratios[len(ratios) // 2])
    speed_ok, speed_ok_norepack, mem_ok = two[1] >= 10, two[2] >= 10, two[5] <= 2
    lines += [
        "",
        "- *end to end*: ours from the files on disk (read, hash, decode, locate, scatter, CPU repack, "
        "post-hash verify) against vLLM's loader on entries already decoded.",
        "- *without CPU repack*: the same, minus the CPU-only repack that neither vLLM path does.",
        "- *commit without repack*: only the part of ours that holds the engine (scatter + verify).",
        "",
        f"### Targets at {two[0]:.0%}",
        "",
        f"- **>= 10x faster than vLLM's NaN-staged loader:** {'met' if speed_ok else 'NOT met'} end to end "
        f"({two[1]:.1f}x); {'met' if speed_ok_norepack else 'NOT met'} without the CPU-only repack "
        f"({two[2]:.1f}x).",
        f"- **Extra memory <= 2x payload:** {'met' if mem_ok else 'NOT met'} ({two[5]:.2f}x).",
        "",
        "## Second samples (reverse applies, NEW -> BASE) and first calls",
        "",
        "| method | density | direction | time | extra mem |",
        "|---|---:|---|---:|---:|",
    ]
    for r in res["runs"]:
        if r["direction"] != "fwd" or r["method"].startswith("ours:"):
            lines.append(f"| {r['method']} | {r['density']:.1%} | {r['direction']} | {r['total_s']:.3f} s "
                         f"| {r['extra'] / MB:.0f} MB |")
    extras = [r for r in res["runs"] if r["method"].startswith("ours:")]
    if extras:
        lines += ["", "Rows `ours:<encoding>` are our apply of the same changes in another encoding "
                  "(`ulp_zstd` is base-relative: vLLM's loader cannot take it)."]
    lines += [
        "",
        "## Where our time goes",
        "",
        facts.get("analysis", ""),
        "",
        "## Reproduce",
        "",
        "```",
        ".venv/bin/python benchmarks/apply.py",
        "```",
        "",
        f"Options: `--layers`, `--densities`, `--encoding`, `--extra-encodings`, `--no-profile` (skip the "
        f"extra cProfile'd apply). Raw numbers: `{out.name.replace('.md', '.json')}`.",
        "",
    ]
    out.write_text("\n".join(lines))
    summary = [f"density {d:.1%}: vLLM/ours {r1:.1f}x end to end, {r2:.1f}x without CPU repack; "
               f"full/ours {r4:.1f}x; ours extra mem {m:.2f}x payload" for d, r1, r2, r3, r4, m in ratios]
    return summary


def plot(path: Path, res: dict, densities: list[float], full_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [d * 100 for d in densities]
    ours = [pick(res, "ours", d) for d in densities]
    ax.plot(xs, [o["total_s"] for o in ours], "o-", label="ours (end to end)")
    ax.plot(xs, [o["total_s"] - o["repack_s"] for o in ours], "o--", label="ours without CPU repack")
    ax.plot(xs, [pick(res, "vllm", d)["total_s"] for d in densities], "s-", label="vLLM load_checkpoint_weight_patches")
    ax.axhline(full_s, color="gray", ls=":", label="full load_weights")
    ax.set_yscale("log")
    ax.set_xlabel("density (% of elements changed)")
    ax.set_ylabel("seconds (log)")
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
    p.add_argument("--no-profile", action="store_true", help="skip the extra cProfile'd apply")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
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
        deltas, changed = {}, {}
        for d in a.densities:
            t = time.perf_counter()
            deltas[d], changed[d] = make_deltas(base, base_digests, d, work, [a.encoding, *a.extra_encodings],
                                                new_dir if d == a.full_density else None, cfg)
            print(f"deltas at {d:.1%}: {changed[d] / 1e6:.2f} M changed, {a.encoding} "
                  f"{dir_bytes(deltas[d][a.encoding + '_fwd']) / MB:.0f} MB ({time.perf_counter() - t:.0f}s)",
                  flush=True)
        del base
        gc.collect()
        res = run_engine(base_dir, new_dir, deltas, a)
        facts = {"params": params, "tensors": len(base_digests), "deltas": deltas,
                 "wall_s": time.perf_counter() - start}
        prof = None if a.no_profile else pick(res, "ours", a.full_density, "profiled").get("profile")
        facts["analysis"] = analysis(res, a) + (f"\n\ncProfile of the {a.full_density:.0%} apply:\n\n```\n{prof}```"
                                                 if prof else "")
        a.out.mkdir(parents=True, exist_ok=True)
        summary = write_report(a.out / "apply.md", res, a, facts)
        (a.out / "apply.json").write_text(json.dumps({k: v for k, v in res.items()}, indent=1, default=str))
        plot(a.out / "apply_time_vs_density.png", res, sorted(deltas), pick(res, "full", a.full_density)["total_s"])
        print("\n".join(summary))
        print(f"wrote {a.out / 'apply.md'} in {time.perf_counter() - start:.0f}s")
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def analysis(res: dict, a) -> str:
    """Phase shares of our apply at each density, from the measured numbers."""
    rows = ["| density | decode+locate | of which locate | scatter | CPU repack | post-hash verify |",
            "|---:|---:|---:|---:|---:|---:|"]
    for d in sorted({r["density"] for r in res["runs"] if r["method"] == "ours" and r["direction"] == "fwd"}):
        o = pick(res, "ours", d)
        t = o["total_s"]
        rows.append(f"| {d:.1%} | {o['prepare_s'] / t:.0%} | {o['locate_s'] / t:.0%} | {o['scatter_s'] / t:.0%} "
                    f"| {o['repack_s'] / t:.0%} | {o['verify_s'] / t:.0%} |")
    o = pick(res, "ours", a.full_density)
    v = pick(res, "vllm", a.full_density)
    full = pick(res, "full", a.full_density)
    model_wide = o["repack_s"] + o["verify_s"]
    notes = [
        "",
        f"At {a.full_density:.0%}, {model_wide:.2f} s of our {o['total_s']:.2f} s is work that grows with the "
        "model, not with the changes: at these densities every tensor is touched, so the CPU repack re-packs "
        f"every linear layer ({o['repack_s']:.2f} s) and the post-apply check rebuilds and hashes every "
        f"tensor ({o['verify_s']:.2f} s). vLLM's whole NaN-staged loader took {v['total_s']:.2f} s and a "
        f"full `load_weights` of in-memory tensors {full['total_s']:.2f} s: on a 1 GB model, one pass over "
        "the weights is cheap, so a 10x margin over the staged loader leaves no room for any pass over the "
        "model. The O(changed) part (decode + locate + scatter) took "
        f"{o['prepare_s'] + o['scatter_s']:.2f} s for {o['changed'] / 1e6:.1f} M entries on one thread "
        f"({(o['prepare_s'] + o['scatter_s']) / o['changed'] * 1e9:.0f} ns per entry).",
        "",
        "Memory: the staged update (int64 storage offsets + bf16 values) is itself one payload, held from "
        "prepare to commit; on top of it come the decode buffers of one flush file, the rebuilt tensor for "
        "the post-hash check (up to the largest tensor, 65 MB here) and the repack's temporary copy of one "
        "layer. These fixed terms dominate at low density.",
    ]
    return "Share of our end-to-end time per phase:\n\n" + "\n".join(rows) + "\n".join(notes)


if __name__ == "__main__":
    main()
