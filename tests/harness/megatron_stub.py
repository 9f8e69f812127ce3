"""A megatron-core model chunk as the hook reads it, without megatron's parallel state, and mbridge
bridges for the tiny families with explicit parallel coordinates.

Why: the hook's map and replica rules read a chunk only through `named_parameters()`,
`state_dict()` and `decoder.layers[i].layer_number`. A real GPTModel needs megatron's parallel
state (a process group); this stand-in holds zero tensors under the names, shapes and TP
attributes the test gives, so those rules run in-process in the light suite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.tiny_models import SPECS

# name -> (local shape, TP partition dim or None for a replicated param)
ParamSpec = dict[str, tuple[tuple[int, ...], int | None]]


def stub_chunk(
    params: ParamSpec, layer_numbers: Sequence[int] = (), buffers: dict[str, tuple[int, ...]] | None = None
) -> torch.nn.Module:
    """A module tree holding `params` (bf16) and `buffers` (fp32) under their dotted names;
    `decoder.layers[i].layer_number` is `layer_numbers[i]` (1-based global layer, as megatron's)."""
    root = torch.nn.Module()
    if layer_numbers:
        root.decoder = torch.nn.Module()
        root.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in layer_numbers)
        for layer, number in zip(root.decoder.layers, layer_numbers):
            layer.layer_number = number
    for name, (shape, dim) in params.items():
        owner, leaf = _owner(root, name)
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
        if dim is not None:
            p.tensor_model_parallel, p.partition_dim = True, dim
        owner.register_parameter(leaf, p)
    for name, shape in (buffers or {}).items():
        owner, leaf = _owner(root, name)
        owner.register_buffer(leaf, torch.zeros(shape, dtype=torch.float32))
    return root


def _owner(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = name.split(".")
    m = root
    for part in path:
        child = m._modules.get(part)
        if child is None:
            if isinstance(m, torch.nn.ModuleList):
                raise KeyError(f"{name}: layer {part} is not in the chunk's decoder.layers")
            child = torch.nn.Module()
            m.add_module(part, child)
        m = child
    return m, leaf


def make_bridge(family: str, **parallel: int):
    """mbridge's bridge for a tiny family's config at the given `ParallelStates` coordinates."""
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates

    cfg = SPECS[family].make_config()
    if not hasattr(cfg, "rope_theta"):  # transformers 5 moved it into rope_parameters
        cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return AutoBridge.from_config(cfg, parallel_states=ParallelStates(**parallel))


def storage_of(t: torch.Tensor) -> int:
    """The address of a tensor's storage: which stub parameter a segment's view reads."""
    return t.untyped_storage().data_ptr()
