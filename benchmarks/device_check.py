"""Device check: our apply path on a synthetic model whose weight loaders are shaped like vLLM's.

Why: CI has no GPU, so this one script is what proves, when a GPU is lent, that prepare + commit
run on device tensors, stay bit-exact and cost what we claim. It needs torch and this repo's
wire dependencies (numpy, safetensors, xxhash, zstandard, pydantic), never vLLM: the synthetic
model's `load_weights` does what vLLM's loaders do to a checkpoint (TP row / column slices, fused
qkv with replicated kv heads, fused gate_up, a fused-MoE expert dimension, optional EP, a
vocab-parallel embedding and replicated norms), and the check compares our in-place apply with
a direct `load_weights` of the new checkpoint into a fresh model of the same rank.

    python benchmarks/device_check.py                       # CUDA, >= 1 B params, writes docs/results/
    python benchmarks/device_check.py --device cpu --size tiny --out /tmp/dc   # what CI runs

Sections (`--sections a,b`): `apply` (bit-exactness at each density, and decode / prepare /
commit / verify times), `apply_moe` (the batched apply where thousands of expert tensors feed
fused params: times, ops per sync, bit-exactness) and `sender` (the sender's scan with the snapshot on the device and in
pinned host memory, checked against the positions each step moved; benchmarks/device_sender.py)
and `collective` (the NCCL transport's pinned host-to-device stream of a delta's flushes, one at a
time, and back, bit-exact; benchmarks/device_collective.py says why it is one process).
Each section is one function taking (args, ctx) and returning a dict.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    from vllm_delta.engine import batched
    from vllm_delta.engine.apply import DeltaApplier
    from vllm_delta.engine.digests import Ownership, check_partials, coverage
    from vllm_delta.wire import DeltaWriter, iter_delta, load_manifest, open_delta, write_manifest
    from vllm_delta.wire.additive import partial_sum, tensor_sum, to_hex
except ModuleNotFoundError as exc:  # a torch-only image: say what to carry instead of a bare traceback
    sys.exit(
        f"device_check: missing {exc.name!r}; the wire format needs numpy, safetensors, xxhash, zstandard "
        "and pydantic (carry cp312 wheels of the missing ones)"
    )

DENSITIES = (0.005, 0.02, 0.05)


@dataclass(frozen=True)
class Config:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    moe_layers: int  # the last `moe_layers` layers have experts instead of a dense MLP
    experts: int
    moe_inter: int


SIZES = {
    # ~1.1 B params: the size the issue asks timings for.
    "1b": Config(
        vocab=32000,
        hidden=2048,
        layers=20,
        heads=16,
        kv_heads=4,
        head_dim=128,
        inter=5632,
        moe_layers=2,
        experts=8,
        moe_inter=1408,
    ),
    # CI: a few thousand params; kv_heads=1 < tp, so kv heads are replicated across ranks.
    "tiny": Config(
        vocab=64,
        hidden=16,
        layers=2,
        heads=4,
        kv_heads=1,
        head_dim=4,
        inter=24,
        moe_layers=1,
        experts=4,
        moe_inter=8,
    ),
}


def checkpoint_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """HF-style names and shapes of the full (unsharded) checkpoint."""
    h, hd = cfg.hidden, cfg.head_dim
    out = {
        "model.embed_tokens.weight": (cfg.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab, h),
    }
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        out.update(
            {
                f"{p}.self_attn.q_proj.weight": (cfg.heads * hd, h),
                f"{p}.self_attn.k_proj.weight": (cfg.kv_heads * hd, h),
                f"{p}.self_attn.v_proj.weight": (cfg.kv_heads * hd, h),
                f"{p}.self_attn.o_proj.weight": (h, cfg.heads * hd),
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
            }
        )
        if i >= cfg.layers - cfg.moe_layers:
            for e in range(cfg.experts):
                out.update(
                    {
                        f"{p}.mlp.experts.{e}.gate_proj.weight": (cfg.moe_inter, h),
                        f"{p}.mlp.experts.{e}.up_proj.weight": (cfg.moe_inter, h),
                        f"{p}.mlp.experts.{e}.down_proj.weight": (h, cfg.moe_inter),
                    }
                )
        else:
            out.update(
                {
                    f"{p}.mlp.gate_proj.weight": (cfg.inter, h),
                    f"{p}.mlp.up_proj.weight": (cfg.inter, h),
                    f"{p}.mlp.down_proj.weight": (h, cfg.inter),
                }
            )
    return out


# ---- a model whose loaders do what vLLM's do ---------------------------------------------------


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: str, loader: Callable) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class SyntheticLM(nn.Module):
    """One TP rank of a Llama/MoE-shaped model; `load_weights` takes full checkpoint tensors."""

    def __init__(
        self,
        cfg: Config,
        *,
        rank: int = 0,
        tp: int = 1,
        ep: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        for n in (cfg.vocab, cfg.heads, cfg.inter, cfg.moe_inter, cfg.experts):
            assert n % tp == 0, f"{n} is not divisible by tp={tp}"
        self.cfg, self.rank, self.tp, self.ep = cfg, rank, tp, ep
        h, hd = cfg.hidden, cfg.head_dim
        self.kv_local = max(1, cfg.kv_heads // tp)
        self.q_rows, self.kv_rows = cfg.heads // tp * hd, self.kv_local * hd
        self.experts_local = cfg.experts // tp if ep else cfg.experts
        self.moe_local = cfg.moe_inter if ep else cfg.moe_inter // tp
        mk = lambda shape, loader: _param(shape, dtype, device, loader)  # noqa: E731
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = mk((cfg.vocab // tp, h), self._rows)
        self.model.norm = nn.Module()
        self.model.norm.weight = mk((h,), self._replicated)
        self.lm_head = nn.Module()
        self.lm_head.weight = mk((cfg.vocab // tp, h), self._rows)
        self.model.layers = nn.ModuleList()
        for i in range(cfg.layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = nn.Module()
            layer.self_attn.qkv_proj.weight = mk((self.q_rows + 2 * self.kv_rows, h), self._qkv)
            layer.self_attn.o_proj = nn.Module()
            layer.self_attn.o_proj.weight = mk((h, cfg.heads // tp * hd), self._cols)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                setattr(layer, norm, nn.Module())
                getattr(layer, norm).weight = mk((h,), self._replicated)
            layer.mlp = nn.Module()
            if i >= cfg.layers - cfg.moe_layers:
                layer.mlp.experts = nn.Module()
                layer.mlp.experts.w13_weight = mk((self.experts_local, 2 * self.moe_local, h), self._expert)
                layer.mlp.experts.w2_weight = mk((self.experts_local, h, self.moe_local), self._expert)
            else:
                layer.mlp.gate_up_proj = nn.Module()
                layer.mlp.gate_up_proj.weight = mk((2 * cfg.inter // tp, h), self._gate_up)
                layer.mlp.down_proj = nn.Module()
                layer.mlp.down_proj.weight = mk((h, cfg.inter // tp), self._cols)
            self.model.layers.append(layer)

    # Loaders: (param, full checkpoint tensor, shard id). Like vLLM's, they narrow the checkpoint
    # tensor to this rank's slice and copy it into (a narrowed view of) the parameter.
    def _replicated(self, param: torch.Tensor, w: torch.Tensor, shard=None) -> None:
        param.data.copy_(w)

    def _rows(self, param: torch.Tensor, w: torch.Tensor, shard=None) -> None:
        n = param.shape[0]
        param.data.copy_(w.narrow(0, self.rank * n, n))

    def _cols(self, param: torch.Tensor, w: torch.Tensor, shard=None) -> None:
        n = param.shape[1]
        param.data.copy_(w.narrow(1, self.rank * n, n))

    def _qkv(self, param: torch.Tensor, w: torch.Tensor, shard: str) -> None:
        if shard == "q":
            start, n, src = 0, self.q_rows, self.rank
        else:  # kv heads: replicated over tp / kv_heads ranks when there are fewer heads than ranks
            replicas = max(1, self.tp // self.cfg.kv_heads)
            start, n, src = (
                self.q_rows + (0 if shard == "k" else self.kv_rows),
                self.kv_rows,
                self.rank // replicas,
            )
        param.data.narrow(0, start, n).copy_(w.narrow(0, src * n, n))

    def _gate_up(self, param: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        n = param.shape[0] // 2
        param.data.narrow(0, shard * n, n).copy_(w.narrow(0, self.rank * n, n))

    def _expert(self, param: torch.Tensor, w: torch.Tensor, shard: tuple[int, str]) -> None:
        expert, kind = shard
        if self.ep:
            expert -= self.rank * self.experts_local
            if not 0 <= expert < self.experts_local:
                return  # another rank's expert
        n, tp_rank = self.moe_local, 0 if self.ep else self.rank
        if kind == "down":
            param.data[expert].copy_(w.narrow(1, tp_rank * n, n))
        else:
            param.data[expert].narrow(0, 0 if kind == "gate" else n, n).copy_(w.narrow(0, tp_rank * n, n))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            parts = name.split(".")
            if ".experts." in name:
                e, proj = int(parts[-3]), parts[-2].removesuffix("_proj")
                target = ".".join(parts[:-3]) + (".w2_weight" if proj == "down" else ".w13_weight")
                shard = (e, proj)
            elif parts[-2] in ("q_proj", "k_proj", "v_proj"):
                target, shard = ".".join(parts[:-2] + ["qkv_proj", "weight"]), parts[-2][0]
            elif parts[-2] in ("gate_proj", "up_proj"):
                target, shard = ".".join(parts[:-2] + ["gate_up_proj", "weight"]), int(parts[-2] == "up_proj")
            else:
                target, shard = name, None
            param = params[target]
            param.weight_loader(param, w, shard)


# ---- deltas --------------------------------------------------------------------------------


def random_checkpoint(cfg: Config, device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        n: (torch.randn(s, generator=g, device=device) * 0.02).to(torch.bfloat16)
        for n, s in checkpoint_shapes(cfg).items()
    }


def step(old: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """An optimizer-like step: `density` of the elements move by +-1 ULP (some by more)."""
    out = {}
    for i, (n, t) in enumerate(old.items()):
        g = torch.Generator(device=t.device).manual_seed(seed * 100003 + i)
        bits = t.reshape(-1).view(torch.int16).clone()
        hit = torch.rand(bits.shape, generator=g, device=t.device) < density
        move = torch.randint(-3, 4, bits.shape, generator=g, device=t.device, dtype=torch.int16)
        move[move == 0] = 1
        bits[hit] += move[hit]
        out[n] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def write_delta(
    path: Path,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    version: int,
    encoding: str = "ulp_zstd",
    **writer_options: Any,
) -> int:
    """A delta old -> new with additive digests computed on the full tensors; returns its bytes.
    `writer_options` go to `DeltaWriter` (flush size, block policy, layout)."""
    digests = {}
    with DeltaWriter(
        path, version=version, base_version=version - 1, encoding=encoding, **writer_options
    ) as writer:
        for name, t in new.items():
            a, b = old[name].reshape(-1), t.reshape(-1)
            bits = {2: torch.int16, 4: torch.int32}[a.element_size()]  # any float dtype's bitwise changes
            pos = torch.nonzero(a.view(bits) != b.view(bits)).squeeze(1)
            if pos.numel():
                writer.add(name, pos.cpu(), b[pos].cpu(), a[pos].cpu(), shape=tuple(t.shape))
                digests[name] = dict(
                    pre_digest=to_hex(partial_sum(pos, a[pos])),
                    post_digest=to_hex(partial_sum(pos, b[pos])),
                    digest=to_hex(tensor_sum(t)),
                )
    manifest = load_manifest(path)
    params = [p.model_copy(update=digests[p.name]) for p in manifest.params]
    write_manifest(path, manifest.model_copy(update={"params": params}))
    return manifest.total_bytes


# ---- the apply section --------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn: Callable):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def section_apply(args: argparse.Namespace, ctx: dict) -> dict:
    """Bit-exact apply at each density on every rank, with decode / prepare / commit / verify times."""
    cfg, device, tp = SIZES[args.size], args.device, args.tp
    shapes = checkpoint_shapes(cfg)
    meta = {n: (s, torch.bfloat16) for n, s in shapes.items()}
    base = random_checkpoint(cfg, device, seed=0)
    ranks = [SyntheticLM(cfg, rank=r, tp=tp, ep=args.ep, device=device) for r in range(tp)]
    for m in ranks:
        m.load_weights(base.items())
    appliers = [DeltaApplier(m, meta, rank=r) for r, m in enumerate(ranks)]
    probe_s = []
    for a in appliers:
        probe_s.append(_timed(device, lambda a=a: a.placements)[1])
    coverages = [coverage(a.placements) for a in appliers]
    for r, a in enumerate(appliers):
        a.ownership = Ownership.from_coverages(coverages, r)
    fallback = sorted({n for a in appliers for n in a.fallback_tensors})
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="device_check_"))
    for version, density in enumerate(args.densities, start=1):
        if (
            time.perf_counter() - ctx["start"] > args.max_s
        ):  # stay inside the machine's time: report, not crash
            rows.append({"density": density, "skipped": f"over --max-s {args.max_s}"})
            continue
        new = step(base, density, seed=version)
        path = tmp / f"v{version}"
        wire_bytes = write_delta(path, base, new, version=version)
        _, decode_s = _timed(
            "cpu", lambda: sum(d.count for d in iter_delta(open_delta(path), current_version=version - 1))
        )
        prepared, prepare_s, decoded_on_device = [], 0.0, []
        for a in appliers:  # ranks run side by side in an engine; here one after another: take the slowest
            staged, s = _timed(
                device,
                lambda a=a: _prepare_on_device(
                    a,
                    decoded_on_device,
                    path,
                    version=version,
                    base_version=version - 1,
                    current_version=version - 1,
                    max_staged_bytes=args.max_staged_bytes,
                ),
            )
            prepared.append(staged)
            prepare_s = max(prepare_s, s)
        replies = [{"digests": s.digests, "expected": s.expected} for s in prepared]
        digests_checked = check_partials(replies)
        commit_s = max(_timed(device, lambda a=a, s=s: a.commit(s))[1] for a, s in zip(appliers, prepared))
        verify_parts, verify_s = [], 0.0
        for a in appliers:
            parts, s = _timed(device, lambda a=a: {n: [None, a.whole_partial(n)] for n in shapes})
            verify_parts.append({"digests": parts})
            verify_s = max(verify_s, s)
        verify_parts[0]["expected"] = {n: [None, to_hex(tensor_sum(t))] for n, t in new.items()}
        whole_checked = check_partials(verify_parts)
        mismatched = []
        for r, m in enumerate(ranks):  # independent reference: a direct load into a fresh rank
            want = SyntheticLM(cfg, rank=r, tp=tp, ep=args.ep, device=device)
            want.load_weights(new.items())
            got = dict(m.named_parameters())
            mismatched += [
                f"rank{r}:{n}"
                for n, p in want.named_parameters()
                if not torch.equal(p.view(torch.int16), got[n].view(torch.int16))
            ]
        changed = prepared[0].total_changed
        decode_h2d = sum(d.uploaded for d in decoded_on_device)
        rows.append(
            {
                "density": density,
                "changed": changed,
                "wire_bytes": wire_bytes,
                "device_decode_batches": sum(len(d.checks) for d in decoded_on_device),
                "decode_h2d_bytes_per_change": decode_h2d / max(sum(s.changed for s in prepared), 1),
                "bytes_per_changed": wire_bytes / max(changed, 1),
                "decode_s": decode_s,
                "prepare_s": prepare_s,
                "commit_s": commit_s,
                "full_verify_s": verify_s,
                "digests_checked": digests_checked,
                "whole_digests_checked": whole_checked,
                "bit_exact": not mismatched,
                "mismatched": mismatched[:10],
            }
        )
        for m in ranks:  # back to the base for the next density
            m.load_weights(base.items())
    params = sum(math.prod(s) for s in shapes.values())
    return {
        "params": params,
        "tp": tp,
        "ep": args.ep,
        "probe_s": probe_s,
        "fallback": fallback,
        "rows": rows,
        "ok": all(r.get("bit_exact", True) for r in rows)
        and any("bit_exact" in r for r in rows)
        and not fallback,
    }


def _prepare_on_device(applier: DeltaApplier, seen: list, path: Path, **kwargs):
    """`prepare` with the delta decoded on the parameters' device (wire/batch_device.py): on a GPU as
    the engine does; on the CPU forced (`batched.FORCE_DEVICE_PATH`), so a CPU run exercises the same
    torch cumsum and plane assembly. `seen` gets the reader's `Decoder` (its batches and bytes)."""
    real = applier._decoder
    applier._decoder = lambda: seen.append(real()) or seen[-1]
    forced, batched.FORCE_DEVICE_PATH = batched.FORCE_DEVICE_PATH, True
    try:
        return applier.prepare(path, **kwargs)
    finally:
        batched.FORCE_DEVICE_PATH = forced
        del applier._decoder


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched: the proxy for kernel launches on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def moe_config(args: argparse.Namespace) -> Config:
    """A production tensor count with tiny hidden sizes: every layer MoE, `--moe-experts` experts each."""
    cpu = args.device == "cpu"
    layers = args.moe_layers or (2 if cpu else 16)
    experts = args.moe_experts or (32 if cpu else 128)
    return Config(
        vocab=256,
        hidden=64,
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=16,
        inter=128,
        moe_layers=layers,
        experts=experts,
        moe_inter=32,
    )


def section_apply_moe(args: argparse.Namespace, ctx: dict) -> dict:
    """The batched apply where thousands of expert tensors feed fused w13/w2 params (TP=1).

    Per density: prepare from the files, the same from decoded deltas (`stage`, what the batching
    changed) and the commit, each synchronized; the ops both dispatch (counted once, after the
    timed run); bit-exactness against a direct load of the new checkpoint into a fresh model.
    """
    cfg, device = moe_config(args), args.device
    shapes = checkpoint_shapes(cfg)
    meta = {n: (s, torch.bfloat16) for n, s in shapes.items()}
    base = random_checkpoint(cfg, device, seed=0)
    model = SyntheticLM(cfg, device=device)
    model.load_weights(base.items())
    applier = DeltaApplier(model, meta)
    _, probe_s = _timed(device, lambda: applier.placements)
    destinations = sum(1 for _ in model.parameters())
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="device_check_moe_"))
    for version, density in enumerate(args.moe_densities, start=1):
        new = step(base, density, seed=version)
        path = tmp / f"v{version}"
        write_delta(path, base, new, version=version)
        staged, prepare_s = _timed(
            device,
            lambda: applier.prepare(
                path,
                version=version,
                base_version=version - 1,
                current_version=version - 1,
                max_staged_bytes=args.max_staged_bytes,
            ),
        )
        replies = [{"digests": staged.digests, "expected": staged.expected}]
        checked = check_partials(replies)
        commit_s = _timed(device, lambda: applier.commit(staged))[1]
        exact = all(
            torch.equal(p.view(torch.int16), dict(model.named_parameters())[n].view(torch.int16))
            for n, p in _direct(cfg, device, new).named_parameters()
        )
        model.load_weights(base.items())
        info = open_delta(path)
        deltas = list(iter_delta(info, expected=meta, current_version=version - 1))
        stage = lambda: applier.stage(info.manifest, deltas, version=version, replay=False, start=0.0)  # noqa: E731
        staged, stage_s = _timed(device, stage)
        commit_s2 = _timed(device, lambda: applier.commit(staged))[1]
        model.load_weights(base.items())
        with _OpCount() as count:
            applier.commit(applier.stage(info.manifest, deltas, version=version, replay=False, start=0.0))
        model.load_weights(base.items())
        rows.append(
            {
                "density": density,
                "changed": staged.changed,
                "tensors": len(deltas),
                "prepare_s": prepare_s,
                "stage_s": stage_s,
                "commit_s": min(commit_s, commit_s2),
                "ops_per_sync": count.ops,
                "digests_checked": checked,
                "bit_exact": exact,
            }
        )
    return {
        "tensors": len(shapes),
        "expert_tensors": 3 * cfg.experts * cfg.moe_layers,
        "destination_params": destinations,
        "probe_s": probe_s,
        "rows": rows,
        "ok": all(r["bit_exact"] for r in rows) and bool(rows),
    }


def _direct(cfg: Config, device: str, weights: dict[str, torch.Tensor]) -> SyntheticLM:
    """The independent reference: the loaders themselves, into a fresh model."""
    model = SyntheticLM(cfg, device=device)
    model.load_weights(weights.items())
    return model


def section_sender(args: argparse.Namespace, ctx: dict) -> dict:
    """The sender's scan on the same synthetic checkpoint (benchmarks/device_sender.py)."""
    from device_sender import section_sender as run

    cfg = SIZES[args.size]
    return run(
        args, ctx, shapes=checkpoint_shapes(cfg), make_weights=lambda: random_checkpoint(cfg, args.device, 0)
    )


def section_collective(args: argparse.Namespace, ctx: dict) -> dict:
    """The collective transport's NCCL form, one flush at a time (benchmarks/device_collective.py)."""
    from device_collective import section_collective as run

    cfg = SIZES[args.size]
    return run(
        args,
        ctx,
        make_weights=lambda: random_checkpoint(cfg, args.device, 0),
        step=step,
        write_delta=write_delta,
    )


def section_bucket_scan(args: argparse.Namespace, ctx: dict) -> dict:
    """The one-pass scan over one contiguous bucket (benchmarks/device_sender.py)."""
    from device_sender import section_bucket_scan as run

    return run(args, ctx)


SECTIONS: dict[str, Callable[[argparse.Namespace, dict], dict]] = {
    "apply": section_apply,
    "apply_moe": section_apply_moe,
    "sender": section_sender,
    "collective": section_collective,
    "bucket_scan": section_bucket_scan,
}


# ---- report -----------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [
        f"# Device check ({env['device_name']}, torch {env['torch']}, size {report['args']['size']})",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    if "apply" in report["sections"]:
        a = report["sections"]["apply"]
        lines += [
            f"## apply: {a['params'] / 1e9:.3f} B params, TP={a['tp']}{' EP' if a['ep'] else ''}, "
            f"probe {max(a['probe_s']):.2f} s per rank, fallback {a['fallback'] or 'none'}",
            "",
            "| density | changed | wire MB | B/changed | decode s | prepare s | commit s | full verify s "
            "| digests checked | bit-exact | device-decoded batches | decode H2D B/change |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in a["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['density']:.1%} | skipped: {r['skipped']} |")
                continue
            lines.append(
                f"| {r['density']:.1%} | {r['changed']:,} | {r['wire_bytes'] / 1e6:.1f} | "
                f"{r['bytes_per_changed']:.2f} | {r['decode_s']:.3f} | {r['prepare_s']:.3f} | "
                f"{r['commit_s']:.3f} | {r['full_verify_s']:.3f} | "
                f"{r['digests_checked']} + {r['whole_digests_checked']} | {r['bit_exact']} | "
                f"{r['device_decode_batches']} | {r['decode_h2d_bytes_per_change']:.2f} |"
            )
        lines += [
            "",
            "decode: read + hash + decode of every flush (CPU); prepare: the same plus locate, "
            "the decode's gap cumsum and value planes on the device (wire/batch_device.py; forced on a CPU "
            "run, where the engine keeps the host decode; decode H2D: the bytes it sent per staged change), "
            "the one copy of offsets and values to the device and the O(changed) pre/post digests there (slowest "
            "rank); commit: ULP resolve, the scatters, the read-back and a synchronize (slowest rank); full verify: "
            "counted-once whole-tensor digests of every tensor (slowest rank).",
        ]
    if "apply_moe" in report["sections"]:
        m = report["sections"]["apply_moe"]
        lines += [
            "",
            f"## apply_moe: {m['tensors']:,} checkpoint tensors ({m['expert_tensors']:,} experts) into "
            f"{m['destination_params']} params, probe {m['probe_s']:.2f} s",
            "",
            "| density | changed | prepare s | of decoded s | commit s | ops per sync | bit-exact |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['density']:.1%} | {r['changed']:,} | {r['prepare_s']:.3f} | {r['stage_s']:.3f} | "
            f"{r['commit_s']:.4f} | {r['ops_per_sync']:,} | {r['bit_exact']} |"
            for r in m["rows"]
        ]
        lines += [
            "",
            "prepare: read, hash, decode, then the batched locate, digests and staging on the "
            "device; of decoded: the same from already decoded deltas (`stage`); commit: the scatters, "
            "read-back and a device synchronize; ops: aten ops of one stage + commit.",
        ]
    if "sender" in report["sections"]:
        from device_sender import sender_markdown

        lines += ["", *sender_markdown(report["sections"]["sender"])]
    if "bucket_scan" in report["sections"]:
        from device_sender import bucket_scan_markdown

        lines += ["", *bucket_scan_markdown(report["sections"]["bucket_scan"])]
    if "collective" in report["sections"]:
        from device_collective import collective_markdown

        lines += ["", *collective_markdown(report["sections"]["collective"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", action="store_true", help="experts split across ranks instead of TP-sliced")
    ap.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    ap.add_argument("--max-staged-bytes", type=int, default=256 << 20)
    ap.add_argument(
        "--moe-layers", type=int, default=0, help="apply_moe: MoE layers (0: 16 on a GPU, 2 on cpu)"
    )
    ap.add_argument("--moe-experts", type=int, default=0, help="apply_moe: experts per layer (0: 128 / 32)")
    ap.add_argument("--moe-densities", type=float, nargs="+", default=[0.005, 0.02])
    ap.add_argument(
        "--scan-gb", type=float, default=2.0, help="bucket_scan: bytes of the bucket on a GPU (CPU: 8 MB)"
    )
    ap.add_argument("--max-s", type=float, default=420.0, help="start no new density after this many seconds")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--name", default="device_check", help="output files NAME.json and NAME.md")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU (use --device cpu for the CI run)")
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
    }
    report = {
        "command": " ".join(["python", "benchmarks/device_check.py", *(argv or sys.argv[1:])]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "sections": {},
    }
    ctx: dict = {"start": time.perf_counter()}
    for name in [s for s in args.sections.split(",") if s]:
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}; known: {', '.join(SECTIONS)}")
        start = time.perf_counter()
        report["sections"][name] = {**SECTIONS[name](args, ctx), "section_s": time.perf_counter() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(report))
    ok = all(s.get("ok", True) for s in report["sections"].values())
    print(json.dumps({"ok": ok, "out": str(args.out / f"{args.name}.json")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
