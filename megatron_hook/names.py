"""Megatron parameter names as mbridge's tables spell them.

Why: mbridge's name tables follow the Transformer-Engine layer spec, where the attention norm is
fused into `linear_qkv` (`layer_norm_weight`), a dense layer's MLP norm into `linear_fc1`, and the
experts of a layer are one grouped module (`experts.linear_fc1.weight{e}`). A model built from
megatron-core's local (non-TE) spec holds the same tensors under other names. Names that are
already TE names pass through unchanged, so this is the identity on a TE-spec model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$")
_LAYER = re.compile(r"^(.*decoder\.layers\.\d+)\.")


def to_te_names(names: Iterable[str]) -> dict[str, str]:
    """{local-spec name: TE-spec name} for every name of one model chunk (expert ids stay local)."""
    names = list(names)
    dense = {m.group(1) for n in names if n.endswith(".mlp.linear_fc1.weight") and (m := _LAYER.match(n))}
    out = {}
    for n in names:
        te = n
        if n.endswith(".input_layernorm.weight"):
            te = n[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
        elif n.endswith(".pre_mlp_layernorm.weight") and (m := _LAYER.match(n)) and m.group(1) in dense:
            te = n[: -len("pre_mlp_layernorm.weight")] + "mlp.linear_fc1.layer_norm_weight"
        elif m := _EXPERT.search(n):
            te = n[: m.start()] + f".mlp.experts.{m.group(2)}.weight{m.group(1)}"
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
