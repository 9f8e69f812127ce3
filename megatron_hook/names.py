"""Megatron parameter names as mbridge's tables spell them.

Why: mbridge's name tables follow the Transformer-Engine layer spec, where a norm is fused into
the one linear that reads it (`layer_norm_weight`): the attention norm into `linear_qkv`, a dense
layer's MLP norm into `linear_fc1`, and MLA's q/kv LoRA norms into `linear_q_up_proj` /
`linear_kv_up_proj`. A norm with two readers stays its own module: MLA's `input_layernorm`
(read by the q and kv down-projections) and a MoE layer's `pre_mlp_layernorm` (router and
experts). The experts of a layer are one grouped module (`experts.linear_fc1.weight{e}`). A
model built from megatron-core's local (non-TE) spec holds the same tensors under other names.
Names that are already TE names pass through unchanged, so this is the identity on a TE-spec
model. The same rules apply inside an MTP layer (`mtp.layers.{k}.transformer_layer`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$")
_LAYER = re.compile(r"^(.*?(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer))\.(.+)$")
# local-spec norm (within a layer) -> the linear the TE spec fuses it into, if the layer has that linear
_FUSED_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.",
    "pre_mlp_layernorm.": "mlp.linear_fc1.",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.",
}


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
    """A local-spec GPTModel as mbridge expects to see it: the same tensors under TE names.

    mbridge reads a model only through `named_parameters()`, `state_dict()` and
    `decoder.layers`; its `load_weights` writes through the state dict's tensors, which share
    storage with the parameters."""

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
