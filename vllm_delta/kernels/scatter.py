"""The commit's scatter (with the ULP resolve) and read-back on CPU weights as compiled loops (`scatter_jit`),
tested equal to the torch path in `engine/commit.py`, which runs off the CPU, for a dtype conversion or
with the kernels off (`switch.on`): each entry read and written once, without int64 offset copies."""

from __future__ import annotations

import torch

from vllm_delta.kernels import switch
from vllm_delta.kernels.digest import bits


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on the CPU (a mixed-device call goes the torch
    way, which refuses it), and switched on."""
    return switch.on() and all(t.device.type == "cpu" for t in tensors)


def scatter(
    flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, base: torch.dtype | None
) -> torch.Tensor | None:
    """`commit.scatter` on CPU tensors: writes the chunk, returns the values written (flat's dtype),
    or None where the kernel does not apply (a dtype conversion, a step in another dtype)."""
    from vllm_delta.kernels import scatter_jit as J

    if base is None:
        if values.dtype != flat.dtype:
            return None
        J.write(bits(flat), offsets.numpy(), bits(values))
        return values
    # How `_resolve` keys the dtype (wire.codecs.order_key); None: not resolved here.
    ints = {torch.uint8: J.UNSIGNED, torch.int8: J.SIGNED, torch.int16: J.SIGNED, torch.int32: J.SIGNED}
    kind = (J.FLOAT if base.itemsize <= 4 else None) if base.is_floating_point else ints.get(base)
    if base != flat.dtype or kind is None or values.element_size() != flat.element_size():
        return None
    out = torch.empty(values.numel(), dtype=flat.dtype)
    J.write_resolved(bits(flat), offsets.numpy(), bits(values), kind, bits(out))
    return out


_FLAG = (torch.tensor(False), torch.tensor(True))  # what `missed` answers: no tensor made per block


def missed(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A bool tensor: some live flat[offsets] differ bitwise from `values` (read after the writes)."""
    from vllm_delta.kernels.scatter_jit import mismatches

    return _FLAG[mismatches(bits(flat), offsets.numpy(), bits(values)) > 0]
