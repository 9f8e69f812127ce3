"""Block-fp8 engines fed by a bf16 trainer: each capture re-quantizes only the blocks holding a changed
bf16 element, by vLLM's `per_block_cast_to_fp8` rule bit for bit (the trainer may have no vLLM). A rank's
part is quantized alone; one that cuts a block is refused at seeding, as vLLM refuses in its TP shards."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_delta.sender.shards import Segments, Shard
from vllm_delta.wire.checkpoint import Checkpoint

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # the reference's clamp: an all-zero block gets a finite scale
SCALE = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
PER_TENSOR_WHY = (
    "per-tensor / channel-wise fp8 is not delta-synced: vLLM serves a fused layer (qkv, gate_up) under one "
    "scale it computes at load (the max of the shards' scales, re-quantized; online, the amax over the "
    "fused weight and its TP shards), which no checkpoint tensor's delta reproduces (the bytes alone would "
    "pay: a moved scale changes 4-5% of the codes under it, docs/results/fp8.md); serve block fp8 "
    "(weight_block_size) or bf16"
)


class Fp8ConfigError(ValueError):
    """A served quantization this sender does not produce (refused at seeding, naming a tensor)."""


@dataclass(frozen=True)
class BlockFp8Spec:
    """What the served config.json's `quantization_config` asks for."""

    block: tuple[int, int]
    ignored: tuple[str, ...]  # `ignored_layers` / `modules_to_not_convert`


def served_spec(q: dict, first_fp8: str) -> BlockFp8Spec:
    """The block-fp8 spec of a `quantization_config`, refused (naming `first_fp8`) if not ours to produce."""
    where = f"{first_fp8 or 'the checkpoint'}: served with quantization_config {q}"
    if q.get("quant_method") != "fp8":
        raise Fp8ConfigError(f"{where}; the sender produces only block fp8 (quant_method 'fp8')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise Fp8ConfigError(f"{where}; the sender produces float8_e4m3fn codes only")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8ConfigError(
            f"{where}; static activation scales (input_scale) are not the trainer's to produce"
        )
    if q.get("scale_fmt"):
        raise Fp8ConfigError(f"{where}; the sender produces float32 weight_scale_inv, not {q['scale_fmt']!r}")
    block = q.get("weight_block_size")
    if block is None:
        raise Fp8ConfigError(f"{where}; {PER_TENSOR_WHY}")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise Fp8ConfigError(f"{where}; weight_block_size must be two positive ints")
    ignored = tuple(q.get("ignored_layers") or ()) + tuple(q.get("modules_to_not_convert") or ())
    return BlockFp8Spec((block[0], block[1]), ignored)


def quantized_weights(meta: dict[str, tuple[tuple[int, ...], torch.dtype]], spec: BlockFp8Spec) -> list[str]:
    """The checkpoint's block-fp8 weights, each with its float32 block scale; anything else fp8 is refused."""
    names = []
    for name, (shape, dtype) in meta.items():
        if name.endswith((".weight_scale", ".input_scale")):
            raise Fp8ConfigError(f"{name}: a per-tensor scale; {PER_TENSOR_WHY}")
        if dtype == torch.float8_e5m2:
            raise Fp8ConfigError(f"{name}: float8_e5m2; the sender produces float8_e4m3fn codes only")
        if dtype != FP8:
            continue
        module = name.removesuffix(".weight")
        if any(module == i or module.startswith(i + ".") or module.endswith("." + i) for i in spec.ignored):
            raise Fp8ConfigError(f"{name}: fp8 in the checkpoint, but the config leaves {module} unquantized")
        want = tuple(math.ceil(n / b) for n, b in zip(shape, spec.block))
        scale = meta.get(name + SCALE)
        if not name.endswith(".weight") or len(shape) != 2 or scale != (want, torch.float32):
            raise Fp8ConfigError(
                f"{name}: fp8 {list(shape)} with scale {scale}; the sender produces a 2-D weight with a "
                f"float32 {name + SCALE} of shape {list(want)} (blocks {list(spec.block)})"
            )
        names.append(name)
    return names


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of `blocks` [k, bm, bn] (bf16), the reference's arithmetic."""
    sf = blocks.abs().float().amax(dim=(1, 2)).clamp(AMAX_FLOOR) / FP8_MAX
    return (blocks * (1.0 / sf)[:, None, None]).to(FP8), sf


Part = Shard | Segments


def _spans(part: Part) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None:
    """(row spans, column spans) whose row-major product is the part's flat order, or None."""
    m, n = part.full_shape
    if isinstance(part, Shard):
        return (part.spans, ((0, n),)) if part.dim == 0 else (((0, m),), part.spans)
    runs: list[tuple[int, int]] = []
    for a, k in part.runs:  # merged where consecutive: a rank's q rows over its query groups are one range
        if runs and runs[-1][0] + runs[-1][1] == a:
            runs[-1] = (runs[-1][0], runs[-1][1] + k)
        else:
            runs.append((a, k))
    (a0, k0), (r0, c0) = runs[0], divmod(runs[0][0], n)
    if len(runs) == 1 and c0 == 0 and k0 % n == 0:
        return ((r0, k0 // n),), ((0, n),)
    if c0 + k0 <= n and all(k == k0 and a == a0 + i * n for i, (a, k) in enumerate(runs)):
        return ((r0, len(runs)),), ((c0, k0),)
    return None


def _aligned(spans: tuple[tuple[int, int], ...], full: int, b: int) -> bool:
    """Every span starts on a block and ends on one, or at the tensor's end as the last span."""
    last = len(spans) - 1
    return all(
        a % b == 0 and ((a + k) % b == 0 or (a + k == full and i == last)) for i, (a, k) in enumerate(spans)
    )


def block_layout(part: Part, block: tuple[int, int]) -> tuple[tuple[int, int], Part]:
    """(the local matrix `part.tensor` reshapes to, whose tiles are whole blocks of the HF weight; where
    its block scales sit in `weight_scale_inv`, over an empty tensor), or `Fp8ConfigError` naming the
    tensor and what this rank holds of it."""
    (m, n), (bm, bn) = part.full_shape, block
    grid = (math.ceil(m / bm), math.ceil(n / bn))
    spans = _spans(part)
    where = f"{part.name}: block-fp8 served ({bm}x{bn} blocks of {[m, n]})"
    if spans is None:
        raise Fp8ConfigError(
            f"{where}; this rank holds flat runs {part.runs[:4]} that are no row/column slice"
        )
    rows, cols = spans
    if not (_aligned(rows, m, bm) and _aligned(cols, n, bn)):
        held = " + ".join(f"[{a}, {a + k})" for a, k in rows), " + ".join(f"[{a}, {a + k})" for a, k in cols)
        raise Fp8ConfigError(
            f"{where}; this rank holds rows {held[0]} x columns {held[1]}, so a block straddles a shard "
            "boundary and its scale would need another rank's elements: use a layout whose shards are whole "
            "blocks (vLLM requires the same of its own TP shards)"
        )
    local = (sum(k for _, k in rows), sum(k for _, k in cols))
    block_rows = tuple((a // bm, math.ceil(k / bm)) for a, k in rows)
    block_cols = tuple((a // bn, math.ceil(k / bn)) for a, k in cols)
    nr, nc = sum(k for _, k in block_rows), sum(k for _, k in block_cols)
    empty = torch.empty((nr, nc), dtype=torch.float32, device=part.tensor.device)
    if isinstance(part, Shard):
        scales: Part = Shard(
            part.name + SCALE, empty, grid, part.dim, block_rows if part.dim == 0 else block_cols
        )
    else:
        ((br, _),), ((bc, _),) = block_rows, block_cols
        runs = (
            ((br * grid[1], nr * grid[1]),)
            if nc == grid[1]
            else tuple(((br + i) * grid[1] + bc, nc) for i in range(nr))
        )
        scales = Segments(part.name + SCALE, empty.reshape(-1), grid, runs)
    return local, scales


class _Tensor:
    """A quantized weight (or a rank's part of it): the last bf16 quantized, its codes and scales."""

    def __init__(self, part: Part, block: tuple[int, int]) -> None:
        (m, n), self.scales = block_layout(part, block)
        (bm, bn), self.shape, self.block = block, (m, n), block
        self.grid = (math.ceil(m / bm), math.ceil(n / bn))
        self.padded = (self.grid[0] * bm, self.grid[1] * bn)
        self.prev: torch.Tensor | None = None  # nothing quantized yet: every block is "changed"
        device = part.tensor.device
        self.codes = torch.zeros(self.padded, dtype=FP8, device=device)
        self.scale = torch.zeros(self.grid, dtype=torch.float32, device=device)

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as [row blocks, bm, column blocks, bn], zero-padded to whole blocks (a copy only then)."""
        (m, n), (pm, pn) = t.shape, self.padded
        if (m, n) != (pm, pn):
            t = torch.nn.functional.pad(t, (0, pn - n, 0, pm - m))
        return t.view(self.grid[0], self.block[0], self.grid[1], self.block[1])

    def changed_blocks(self, w: torch.Tensor) -> torch.Tensor:
        """Flat block indices' mask where a bf16 element's bits moved (on the device, no host sync)."""
        if self.prev is None:
            return torch.ones(self.grid, dtype=torch.bool, device=w.device).reshape(-1)
        moved = w.view(torch.int16) != self.prev.view(torch.int16)
        return self._blocks(moved).any(dim=3).any(dim=1).reshape(-1)

    def requantize(self, w: torch.Tensor, mask: torch.Tensor, count: int) -> None:
        """Re-quantize the `count` blocks `mask` marks: codes and scales written in place."""
        idx = torch.nonzero_static(mask, size=count).reshape(-1)
        rows, cols = idx // self.grid[1], idx % self.grid[1]
        q, sf = quantize_blocks(self._blocks(w)[rows, :, cols, :])
        self._blocks(self.codes.view(torch.uint8))[rows, :, cols, :] = q.view(torch.uint8)  # no fp8 index_put
        self.scale.view(-1)[idx] = sf
        self.prev = w.detach().clone() if self.prev is None else self.prev.copy_(w)

    def shards(self, part: Part) -> list[Part]:
        """The codes where `part` sits in the weight, the scales where its blocks sit in the scale tensor."""
        m, n = self.shape
        codes = self.codes if (m, n) == self.padded else self.codes[:m, :n].contiguous()
        return [part.with_tensor(codes.reshape(part.tensor.shape)), self.scales.with_tensor(self.scale)]


class BlockFp8Quantizer:
    """The sender's block-fp8 stage: bf16 shards of quantized weights in, their codes and scales out."""

    def __init__(self, spec: BlockFp8Spec, names: list[str]) -> None:
        self.spec, self.names = spec, set(names)
        self._tensors: dict[str, _Tensor] = {}
        self.blocks_requantized = 0  # over every capture: the cost that tracks the changes

    @classmethod
    def served(cls, ckpt: Checkpoint, names: list[str] | None = None) -> BlockFp8Quantizer | None:
        """The quantizer checkpoint `ckpt` needs (None if unquantized), for all its tensors or only `names`
        (a rank's: only their shards' headers are read)."""
        path = Path(ckpt.path) / "config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        q = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
        if not q:
            return None
        if names is None:
            meta = ckpt.meta
        else:  # the names, their block and per-tensor scales, and their modules' input scales
            near = (
                c for n in names for c in (n, n + SCALE, n + "_scale", n.rpartition(".")[0] + ".input_scale")
            )
            meta = {c: ckpt.info(c) for c in dict.fromkeys(near) if c in ckpt}
        first = next((n for n, (_, d) in meta.items() if d in (FP8, torch.float8_e5m2)), "")
        spec = served_spec(q, first)
        return cls(spec, quantized_weights(meta, spec))

    def scale_parts(self, parts: list[Part]) -> list[Part]:
        """Where the block scales of `parts`' quantized weights sit (what seeding reads); a part that is not
        bf16 or cuts a block (`block_layout`) is refused, naming the tensor."""
        return [block_layout(_checked(s), self.spec.block)[1] for s in parts if s.name in self.names]

    def apply(self, shards: list[Part]) -> list[Part]:
        """The shards with each quantized bf16 weight replaced by its current codes and scales."""
        todo = []
        for s in shards:
            if s.name in self.names:
                s = _checked(s)
                t = self._tensors.get(s.name) or self._tensors.setdefault(s.name, _Tensor(s, self.spec.block))
                w = s.tensor.detach().contiguous().reshape(t.shape)  # a view if contiguous: read now only
                todo.append((t, w, t.changed_blocks(w)))
        # one host sync, not one per tensor
        counts = torch.stack([m.sum().to(todo[0][1].device) for _, _, m in todo]).tolist() if todo else []
        for (t, w, mask), count in zip(todo, counts):
            if count:
                t.requantize(w, mask, count)
                self.blocks_requantized += count
        done = self._tensors
        return [p for s in shards for p in (done[s.name].shards(s) if s.name in self.names else [s])]


def _checked(s: Part) -> Part:
    if s.tensor.dtype != torch.bfloat16:
        raise TypeError(f"{s.name}: block-fp8 served; the trainer must pass bf16, not {s.tensor.dtype}")
    return s
