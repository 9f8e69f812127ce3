"""Block-fp8 quantization of a rank's part of a weight, against the reference on the whole weight.

A TP rank holds a row slice, a column slice, several row slices (interleaved groups), or, from the
Megatron hook, flat runs over its rows or columns. Where the part's 128x128 tiles are whole blocks of
the HF weight, each rank quantizes its part alone, and the union of every rank's codes and
`weight_scale_inv` values is vLLM's own `per_block_cast_to_fp8` of the whole weight, bit for bit, at
seeding and after a step. A part that cuts a block is refused at seeding, naming the tensor and the rows
and columns the rank holds, before anything is seeded.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_sender import bits, reference, write_checkpoint

from vllm_delta import DeltaSender
from vllm_delta.sender.delta_sender import checkpoint_seed
from vllm_delta.sender.fp8_quant import BlockFp8Quantizer, BlockFp8Spec, Fp8ConfigError
from vllm_delta.sender.shards import Segments, Shard

NAME, SHAPE = "a.q_proj.weight", (384, 300)  # three block rows, an edge block column (300 = 2 x 128 + 44)
M, N = SHAPE


def _rows(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple((r * N, k * N) for r, k in runs)


def _cols(c0: int, c1: int) -> tuple[tuple[int, int], ...]:
    return tuple((r * N + c0, c1 - c0) for r in range(M))


LAYOUTS = {  # each rank's placement: a Shard (dim, spans) or Segments runs
    "shard_rows": [("shard", 0, ((0, 128),)), ("shard", 0, ((128, 256),))],
    "shard_cols_edge": [("shard", 1, ((0, 256),)), ("shard", 1, ((256, 44),))],
    "shard_groups": [("shard", 0, ((0, 128), (256, 128))), ("shard", 0, ((128, 128),))],
    "segments_rows": [("runs", _rows([(0, 128)])), ("runs", _rows([(128, 256)]))],
    "segments_cols_edge": [("runs", _cols(0, 256)), ("runs", _cols(256, 300))],
}


def _part(full: torch.Tensor, how: tuple) -> Shard | Segments:
    if how[0] == "shard":
        _, dim, spans = how
        local = torch.cat([full.narrow(dim, a, k) for a, k in spans], dim=dim)
        return Shard.pieces(NAME, local, SHAPE, dim, spans)
    flat = full.reshape(-1)
    return Segments(NAME, torch.cat([flat[a : a + k] for a, k in how[1]]), SHAPE, how[1])


def _union(parts: list[Shard | Segments], grid: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every rank's shipped codes and scales written into whole tensors (each element exactly once)."""
    out = {NAME: torch.zeros(M * N, dtype=torch.uint8), NAME + "_scale_inv": torch.zeros(grid).reshape(-1)}
    seen = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in out.items()}
    for p in parts:
        pos = p.global_index()
        out[p.name].view(bits(out[p.name]).dtype)[pos] = bits(p.tensor).reshape(-1)
        seen[p.name][pos] += 1
    assert all(bool((s == 1).all()) for s in seen.values())
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_quantizes_its_whole_blocks_as_the_reference_does(tmp_path, layout):
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(SHAPE, generator=gen) * 0.05).to(torch.bfloat16)
    w[:, 256:] *= 4  # the edge block column's scales differ from the rest
    codes, scales = reference(w)
    ckpt = write_checkpoint(tmp_path / "ckpt", {NAME: codes, NAME + "_scale_inv": scales})
    quantizers = [BlockFp8Quantizer(BlockFp8Spec((128, 128), ()), [NAME]) for _ in LAYOUTS[layout]]
    for step in range(2):
        if step:  # a step that moves the edge column's extreme and one interior element
            w[383, 299], w[5, 7] = 1.5, -0.25
            codes, scales = reference(w)
        parts = [_part(w, how) for how in LAYOUTS[layout]]
        shipped = [s for q, p in zip(quantizers, parts) for s in q.apply([p])]
        if not step:  # seeding reads each rank's codes and scales where its capture will place them
            seeded = [s for p in parts for s in checkpoint_seed(ckpt, None, [p])[0]]
            assert [s.describe() for s in seeded] == [s.describe() for s in shipped]
            assert all(
                torch.equal(bits(a.tensor).view(-1), bits(b.tensor).view(-1)) for a, b in zip(seeded, shipped)
            )
        got = _union(shipped, tuple(scales.shape))
        assert torch.equal(got[NAME], bits(codes).reshape(-1)), step
        assert torch.equal(bits(got[NAME + "_scale_inv"]), bits(scales).reshape(-1)), step
    assert sum(q.blocks_requantized for q in quantizers) == 9 + 2  # all nine blocks, then the two touched


@pytest.mark.parametrize(
    "how, held",
    [
        (("shard", 0, ((0, 100),)), r"rows \[0, 100\) x columns \[0, 300\)"),
        (("shard", 0, ((0, 128), (200, 56))), r"rows \[0, 128\) \+ \[200, 256\) x columns \[0, 300\)"),
        (("runs", _cols(64, 300)), r"rows \[0, 384\) x columns \[64, 300\)"),
        (
            ("runs", ((0, 10), (N + 5, 10))),
            r"flat runs \(\(0, 10\), \(305, 10\)\) that are no row/column slice",
        ),
    ],
    ids=["rows_cut_a_block", "a_group_cuts_a_block", "columns_cut_a_block", "not_a_slice"],
)
def test_a_part_that_cuts_a_block_is_refused_naming_it(tmp_path, how, held):
    w = torch.zeros(SHAPE, dtype=torch.bfloat16)
    codes, scales = reference(w)
    ckpt = write_checkpoint(tmp_path / "ckpt", {NAME: codes, NAME + "_scale_inv": scales})
    sender = DeltaSender([], "disk", tmp_path / "d")
    try:
        with pytest.raises(Fp8ConfigError, match=rf"^a\.q_proj\.weight: block-fp8 served .*{held}"):
            sender.seed_from_checkpoint(ckpt, like=[_part(w, how)])
        assert sender.producer.names == [] and sender.fp8 is None  # nothing seeded
    finally:
        sender.close()
