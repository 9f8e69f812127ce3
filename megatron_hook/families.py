"""What the map must know about a model chunk that mbridge's tables do not say: a local-spec model's
names in the TE spec mbridge reads (fused norms, grouped experts), the vocab padding Megatron-LM and slime
add on their own, tied MTP copies that ship nothing, and what is refused (legacy `GroupedMLP`, expert TP
with TP = 1)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch

_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.weight[12]$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$")
_LAYER = re.compile(r"^(.*?(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer))\.(.+)$")
# local-spec norm (within a layer) -> the linear the TE spec fuses it into, if the layer has that linear
_FUSED_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.",
    "pre_mlp_layernorm.": "mlp.linear_fc1.",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.",
}


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
    """`bridge` told the vocab padding `gpt`'s tensors have (a shallow copy); another claimed is refused."""
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


def to_te_names(names: Iterable[str]) -> dict[str, str]:
    """{local-spec name: TE-spec name} for every name of one model chunk (expert ids stay local)."""
    names = list(names)
    layers: dict[str, set[str]] = {}
    for n in names:
        if m := _LAYER.match(n):
            layers.setdefault(m.group(1), set()).add(m.group(2))
    out = {}
    for n in names:
        te = n
        if m := _EXPERT.search(n):
            te = n[: m.start()] + f".mlp.experts.{m.group(2)}.weight{m.group(1)}"
        elif m := _LAYER.match(n):
            layer, rest = m.groups()
            for norm, linear in _FUSED_NORMS.items():
                if rest.startswith(norm) and linear + "weight" in layers[layer]:
                    te = f"{layer}.{linear}layer_norm_{rest[len(norm) :]}"
                    break
        out[n] = te
    return out


class TENamed:
    """A local-spec GPTModel under TE names, as mbridge reads a model: `named_parameters()`,
    `state_dict()` (whose tensors share storage with the parameters) and `decoder.layers`."""

    def __init__(self, gpt) -> None:
        self.gpt = gpt
        if hasattr(gpt, "decoder"):  # mbridge renumbers layers from decoder.layers[i].layer_number
            self.decoder = gpt.decoder
        self.te = to_te_names(k for k in gpt.state_dict() if "_extra_state" not in k)

    def named_parameters(self):
        for name, p in self.gpt.named_parameters():
            yield self.te[name], p

    def state_dict(self):
        return {self.te[k]: v for k, v in self.gpt.state_dict().items() if "_extra_state" not in k}
