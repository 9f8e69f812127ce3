"""What the map must know about a model chunk that mbridge's tables do not say.

- Vocab padding: mbridge trims padded rows only when it built the model; Megatron-LM and slime pad on
  their own, so the padding is read from the model's real tensor shapes.
- Tied copies: a later stage's MTP copy of the word embeddings ships nothing; the first stage ships them.
- Refused at registration, naming the module: legacy `GroupedMLP` (no mbridge name table), and expert
  TP with TP = 1 (mbridge's `_weight_merge_across_tp` then keeps one shard).
"""

from __future__ import annotations

import copy
import re

import torch

_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.weight[12]$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def tied_copy(gpt: torch.nn.Module, name: str) -> bool:
    """True for a tensor this chunk holds only as a copy of another stage's: not shipped from here."""
    return name == "embedding.word_embeddings.weight" and not getattr(gpt, "pre_process", True)


def refuse_unsupported(names: list[str], tp_size: int, etp_size: int) -> None:
    """Raise `NotImplementedError` naming the first module the map cannot place exactly."""
    for n in names:
        if m := _GROUPED.match(n):
            raise NotImplementedError(
                f"{m.group(1)}: legacy GroupedMLP (moe_use_legacy_grouped_gemm) has no mbridge name table; "
                "build the experts as TEGroupedMLP or SequentialMLP"
            )
        if ".mlp.experts." in n and etp_size > tp_size == 1:
            raise NotImplementedError(
                f"{n.rsplit('.mlp.experts.', 1)[0]}.mlp.experts: expert tensor parallel size {etp_size} with "
                "tensor parallel size 1: mbridge 0.15.1's _weight_merge_across_tp merges nothing when TP = 1"
            )


def with_model_vocab(bridge, gpt: torch.nn.Module, tp_size: int):
    """A shallow copy of `bridge` told the vocab padding that `gpt`'s own tensors have (`bridge`
    itself for a chunk without vocab-parallel tensors); a bridge that claims another padding is refused."""
    rows = {
        n: t.shape[0] * (tp_size if getattr(t, "tensor_model_parallel", False) else 1)
        for n, t in gpt.named_parameters()
        if n in _VOCAB
    }
    if not rows:
        return bridge
    padded, vocab = max(rows.values()), bridge.hf_config.vocab_size
    if len(set(rows.values())) != 1 or padded < vocab:
        raise ValueError(
            f"vocab-parallel tensors hold {rows} rows over TP={tp_size}; the HF vocab is {vocab}"
        )
    claimed = bridge.padded_vocab_size if bridge.make_vocab_size_divisible_by is not None else None
    if claimed is not None and claimed != padded:
        raise ValueError(f"the bridge pads the vocab to {claimed} rows but the model's tensors hold {padded}")
    out = copy.copy(bridge)
    # mbridge trims rows past vocab_size whenever make_vocab_size_divisible_by is set
    out.make_vocab_size_divisible_by = padded if padded > vocab else None
    out.vocab_size, out.padded_vocab_size = vocab, padded
    return out
