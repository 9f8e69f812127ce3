"""Sender benchmarks P3 and P4 (issue 5); writes docs/results/sender.md and sender_syncs.png.

P3: diff + encode of a whole model at 2% density vs a plain memcpy of the same bytes, one run.
P4: 20 end-to-end syncs of a ~0.5 B-param Llama at 2% density to a real CPU `vllm serve`, the
    flush files paced to 300 MB/s by the disk transport's throttled writer, against a full sync
    over the same link: the full bf16 checkpoint through the same throttled writer plus vLLM's own
    in-place reload of the weights from disk (`reload_weights` via the dev `/collective_rpc`).

Run: .venv/bin/python benchmarks/sender.py [--syncs 20] [--layers 26]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.tiny_models import make_tiny_model  # noqa: E402
from harness.vllm_engine import VllmServer  # noqa: E402
from vllm_delta import DeltaSender  # noqa: E402
from vllm_delta.diff import changed_positions  # noqa: E402
from vllm_delta.wire import FlushBuilder  # noqa: E402
from vllm_delta.transports.disk import Throttle, throttled_write  # noqa: E402

LINK = 300e6  # bytes per second
DENSITY = 0.02


def make_model(out: Path, layers: int) -> Path:
    """A Llama-shaped bf16 checkpoint of ~0.5 B params with random weights (tokenizer from the tiny model)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tiny = make_tiny_model("llama", out.parent / "tiny")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    cfg = LlamaConfig(vocab_size=48000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=512,
                      torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    h, i, kv = 1024, 4096, 8 * 64
    shapes = {"model.embed_tokens.weight": (48000, h), "lm_head.weight": (48000, h), "model.norm.weight": (h,)}
    for l in range(layers):
        p = f"model.layers.{l}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    tensors = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
               for n, s in shapes.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def step(weights: dict[str, torch.Tensor], gen: torch.Generator, density: float = DENSITY) -> None:
    """An Adam-like step: a random `density` of elements each move by ±1 ULP (2-D tensors)."""
    for t in weights.values():
        if t.dim() < 2:
            continue
        bits = t.view(-1).view(torch.int16)
        n = bits.numel()
        idx = torch.randint(0, n, (int(n * density),), generator=gen)
        bits[idx] += torch.where(torch.rand(idx.numel(), generator=gen) < 0.5, 1, -1).to(torch.int16)


def p3(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    snapshot = {n: t.clone() for n, t in weights.items()}
    step(weights, torch.Generator().manual_seed(1))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    dst = {n: torch.empty_like(t) for n, t in weights.items()}
    for n, t in weights.items():  # touch the destination first: time the copy, not page faults
        dst[n].copy_(t)
    t0 = time.perf_counter()
    for n, t in weights.items():
        dst[n].copy_(t)
    memcpy_s = time.perf_counter() - t0
    del dst
    out = {}
    for enc in ("ulp_zstd", "deltas_zstd"):
        b = FlushBuilder(lambda name, f: None, version=1, base_version=0, encoding=enc, flush_bytes=512 << 20)
        t0 = time.perf_counter()
        diff_s = 0.0
        for n, t in weights.items():
            d0 = time.perf_counter()
            pos = changed_positions(t, snapshot[n])
            diff_s += time.perf_counter() - d0
            flat, sflat = t.view(-1), snapshot[n].view(-1)
            b.add(n, pos, flat[pos], sflat[pos], shape=tuple(t.shape))
        b.manifest()
        out[enc] = {"total_s": time.perf_counter() - t0, "diff_s": diff_s, "wire_bytes": b.wire_bytes}
    # undo so P4 starts from the checkpoint
    for n in weights:
        weights[n].copy_(snapshot[n])
    return {"model_bytes": nbytes, "memcpy_s": memcpy_s, "encodings": out}


def rpc(url: str, method: str, **kwargs) -> float:
    t0 = time.perf_counter()
    r = requests.post(f"{url}/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - t0


def p4(model: Path, weights: dict[str, torch.Tensor], work: Path, syncs: int) -> dict:
    root = work / "root"
    root.mkdir()
    log = work / "serve.log"
    args = ["--enable-delta-updates", "--delta-updates-root", str(root)]
    t0 = time.perf_counter()
    with VllmServer(model, log, extra_args=args, startup_timeout_s=900) as server:
        start_s = time.perf_counter() - t0
        sender = DeltaSender([server.url], "disk", root, throttle_bytes_per_s=LINK, flush_bytes=256 << 20)
        sender.seed_from_checkpoint(model)
        gen = torch.Generator().manual_seed(2)
        rows = []
        for k in range(syncs):
            step(weights, gen)
            m = sender.sync(weights)
            assert m["sender/all_acked"] == 1.0, sender.engines
            rows.append(m)
            print(f"sync {k + 1}: {m['perf/update_weights_time']:.2f}s "
                  f"{m['perf/update_weights_wire_bytes'] / 1e6:.1f} MB pause {m['perf/update_weights_engine_pause_time']:.3f}s "
                  f"encode {m['perf/delta_encode_time']:.2f}s apply {m['perf/update_weights_engine_apply_time']:.2f}s",
                  flush=True)
        # Full sync over the same link: the whole checkpoint through the throttled writer, then
        # vLLM's own in-place reload from disk.
        full_dir = root / "full"
        full_dir.mkdir()
        for f in model.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy2(f, full_dir / f.name)
        data = (model / "model.safetensors").read_bytes()
        t0 = time.perf_counter()
        throttled_write(full_dir / "model.safetensors", data, Throttle(LINK))
        write_s = time.perf_counter() - t0
        del data
        try:
            reload_s = rpc(server.url, "reload_weights", weights_path=str(full_dir))
        except requests.HTTPError as exc:  # reported: the ratio then uses the link time alone
            print(f"vLLM reload_weights failed: {exc}", flush=True)
            reload_s = None
    return {"engine_start_s": start_s, "rows": rows, "full_bytes": (model / "model.safetensors").stat().st_size,
            "full_write_s": write_s, "full_reload_s": reload_s}


def _mean(rows: list[dict], key: str) -> float:
    tail = rows[1:] or rows
    return sum(r[key] for r in tail) / len(tail)


def report(res3: dict, res4: dict, params: int, out_md: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res4["rows"]
    times = [r["perf/update_weights_time"] for r in rows]
    wire = [r["perf/update_weights_wire_bytes"] for r in rows]
    pause = [r["perf/update_weights_engine_pause_time"] for r in rows]
    reload_s = res4["full_reload_s"]
    full_s = res4["full_write_s"] + (reload_s or 0.0)
    reload_txt = f"{reload_s:.2f}" if reload_s is not None else "failed: link time only, a lower bound"
    steady = times[1:] if len(times) > 1 else times
    mean_t = sum(steady) / len(steady)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(1, len(rows) + 1)
    a1.plot(xs, times, "o-", label="delta sync (end to end)")
    a1.plot(xs, pause, "s-", label="engine pause")
    a1.axhline(full_s, color="r", ls="--", label=f"full sync ({full_s:.1f}s)")
    a1.set_yscale("log"); a1.set_xlabel("sync"); a1.set_ylabel("seconds"); a1.legend(); a1.set_title("time per sync")
    a2.plot(xs, [w / 1e6 for w in wire], "o-", label="delta wire bytes")
    a2.axhline(res4["full_bytes"] / 1e6, color="r", ls="--", label="full checkpoint")
    a2.set_yscale("log"); a2.set_xlabel("sync"); a2.set_ylabel("MB"); a2.legend(); a2.set_title("bytes per sync")
    fig.suptitle(f"{params / 1e9:.2f} B-param Llama, {DENSITY:.0%} density, link paced to {LINK / 1e6:.0f} MB/s")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    e3 = res3["encodings"]
    lines = [
        "# Sender benchmarks (P3, P4)",
        "",
        f"Machine: {os.cpu_count()} CPU cores (shared), no GPU. Model: Llama-shaped, {params / 1e6:.0f} M params, "
        f"bf16, random weights; each sync moves a random {DENSITY:.0%} of the elements of every matrix by ±1 ULP. "
        "Reproduce: `.venv/bin/python benchmarks/sender.py`.",
        "",
        "## P3: diff + encode vs memcpy of the same bytes (one run)",
        "",
        "| | seconds | × memcpy |",
        "|---|---|---|",
        f"| memcpy of the model ({res3['model_bytes'] / 1e9:.2f} GB) | {res3['memcpy_s']:.3f} | 1.0 |",
    ]
    for enc, r in e3.items():
        lines.append(f"| bitwise diff + encode, `{enc}` ({r['wire_bytes'] / 1e6:.1f} MB out) | {r['total_s']:.3f} "
                     f"| {r['total_s'] / res3['memcpy_s']:.1f} |")
        lines.append(f"| of which the bitwise diff | {r['diff_s']:.3f} | {r['diff_s'] / res3['memcpy_s']:.1f} |")
    lines += [
        "",
        "Target ≤ 3×. No GPU was available to this run, so GB/s scanned on a device is not measured.",
        "",
        f"## P4: {len(rows)} syncs end to end to a real CPU `vllm serve`, link paced to {LINK / 1e6:.0f} MB/s",
        "",
        "Delta sync = `DeltaSender.sync()` wall time: bitwise diff, `ulp_zstd` encode, flush files written through "
        "the throttled writer (atomic, fsync), one HTTP push, the engine's read + verify + decode + paused scatter "
        "+ post-apply hash check, the ack, and the snapshot advance. Full sync = the full bf16 checkpoint written "
        "through the same throttled writer, plus vLLM's own in-place `reload_weights` from that directory (timed "
        "over the dev `/collective_rpc` route; it does not pause generation explicitly, so its real cost is "
        "higher). If vLLM's `reload_weights` fails on this CPU build, the full sync is the link time alone, "
        "which no full sync can beat. The first delta sync also probes the engine's weight placement once.",
        "",
        "| | delta sync (mean of syncs 2..N) | first sync | full sync |",
        "|---|---|---|---|",
        f"| time | {mean_t:.2f} s | {times[0]:.2f} s | {full_s:.2f} s (write {res4['full_write_s']:.2f} + reload "
        f"{reload_txt}) |",
        f"| bytes on the link | {sum(wire[1:]) / max(1, len(wire) - 1) / 1e6:.1f} MB | {wire[0] / 1e6:.1f} MB | "
        f"{res4['full_bytes'] / 1e6:.0f} MB |",
        f"| engine pause | {sum(pause[1:]) / max(1, len(pause) - 1):.3f} s | {pause[0]:.3f} s | — |",
        "",
        f"Speed-up: **{full_s / mean_t:.1f}×** (target ≥ 25×). Pause / sync: "
        f"**{sum(pause[1:]) / max(1e-9, sum(times[1:])):.1%}** (target ≤ 10%).",
        "",
        "### Where a delta sync's time goes (mean of syncs 2..N)",
        "",
        f"- sender diff + encode + post-apply hashes (`perf/delta_encode_time`): {_mean(rows, 'perf/delta_encode_time'):.2f} s",
        f"- delta bytes on the 300 MB/s link: {sum(wire[1:]) / max(1, len(wire) - 1) / LINK:.3f} s",
        f"- engine read + verify + decode + locate (not paused): {_mean(rows, 'perf/update_weights_engine_decode_time'):.2f} s",
        f"- engine scatter + CPU repack + post-hash check (paused): {_mean(rows, 'perf/update_weights_engine_apply_time'):.2f} s",
        "",
        "On this shared 2-core CPU the link is not the bottleneck: the full checkpoint crosses it in a few "
        "seconds, while diffing, encoding and hashing 0.5 B params on one core costs more than that. The delta "
        "moves ~1% of the bytes, but the targets (≥ 25× faster than a full sync) are not met here; they need a "
        "link that dominates (larger models, slower links) or a sender that scans on an accelerator, neither of "
        "which this run had.",
        "",
        "![time and bytes per sync](sender_syncs.png)",
        "",
        "Per sync (s, MB, pause s, encode s, engine decode s, engine apply s):",
        "",
        "| sync | time | MB | pause | encode | decode | apply |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(rows, 1):
        lines.append(f"| {k} | {r['perf/update_weights_time']:.2f} | {r['perf/update_weights_wire_bytes'] / 1e6:.1f} | "
                     f"{r['perf/update_weights_engine_pause_time']:.3f} | {r['perf/delta_encode_time']:.2f} | "
                     f"{r['perf/update_weights_engine_decode_time']:.2f} | {r['perf/update_weights_engine_apply_time']:.2f} |")
    out_md.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=20)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from sender.json")
    a = ap.parse_args()
    if a.report_only:
        saved = json.loads((a.out / "sender.json").read_text())
        report(saved["p3"], saved["p4"], saved["params"], a.out / "sender.md", a.out / "sender_syncs.png")
        return
    work = Path(tempfile.mkdtemp(prefix="sender-bench-"))
    try:
        model = make_model(work / "model", a.layers)
        from safetensors.torch import load_file

        weights = load_file(model / "model.safetensors")
        params = sum(t.numel() for t in weights.values())
        print(f"model: {params / 1e6:.0f} M params", flush=True)
        res3 = p3(weights)
        print(json.dumps(res3), flush=True)
        res4 = p4(model, weights, work, a.syncs)
        a.out.mkdir(parents=True, exist_ok=True)
        report(res3, res4, params, a.out / "sender.md", a.out / "sender_syncs.png")
        (a.out / "sender.json").write_text(json.dumps({"p3": res3, "p4": res4, "params": params}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
