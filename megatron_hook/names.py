"""Megatron parameter names as mbridge's tables spell them (the Transformer-Engine layer spec).

Why: in the TE spec a norm read by one linear is fused into it (`layer_norm_weight`: the attention norm
into `linear_qkv`, a dense MLP norm into `linear_fc1`, MLA's q/kv LoRA norms into their up-projections)
and a layer's experts are one grouped module; a norm with two readers stays its own. A local-spec model
holds the same tensors under other names; TE names pass through unchanged (MTP layers alike).
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
