"""The commit's scatter (with the ULP resolve) and read-back on CPU weights as compiled loops
(`scatter_jit`), tested equal to the torch path in `engine/commit.py` (tests/engine/test_apply_kernel.py):
each entry read and written once, without torch's int64 offset copies and gathered read-back copy. The
read-back stays a pass of its own after the writes, so it checks them. Off the CPU, for a dtype
conversion or with the kernels off (`switch.on`), the torch path runs.
"""

from __future__ import annotations

import torch

from vllm_delta.kernels import switch
from vllm_delta.kernels.digest import bits


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on the CPU (a mixed-device call goes the torch
    way, which refuses it), and switched on."""
    return switch.on() and all(t.device.type == "cpu" for t in tensors)


def _kind(dtype: torch.dtype) -> int | None:
    """How `scatter_jit._resolve` keys this dtype (wire.codecs.order_key), or None: not resolved here."""
    from vllm_delta.kernels import scatter_jit as J

    if dtype.is_floating_point:
        return J.FLOAT if dtype.itemsize <= 4 else None
    return {torch.uint8: J.UNSIGNED, torch.int8: J.SIGNED, torch.int16: J.SIGNED, torch.int32: J.SIGNED}.get(
        dtype
    )


def scatter(
    flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, base: torch.dtype | None
) -> torch.Tensor | None:
    """`apply.scatter` on CPU tensors: writes the chunk, returns the values written (flat's dtype),
    or None where the kernel does not apply (a dtype conversion, a step in another dtype)."""
    if base is None:
        if values.dtype != flat.dtype:
            return None
        from vllm_delta.kernels.scatter_jit import write

        write(bits(flat), offsets.numpy(), bits(values))
        return values
    kind = _kind(base)
    if base != flat.dtype or kind is None or values.element_size() != flat.element_size():
        return None
    from vllm_delta.kernels.scatter_jit import write_resolved

    out = torch.empty(values.numel(), dtype=flat.dtype)
    write_resolved(bits(flat), offsets.numpy(), bits(values), kind, bits(out))
    return out


_FLAG = (torch.tensor(False), torch.tensor(True))  # what `missed` answers: no tensor made per block


def missed(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A bool tensor: some live flat[offsets] differ bitwise from `values` (read after the writes)."""
    from vllm_delta.kernels.scatter_jit import mismatches

    return _FLAG[mismatches(bits(flat), offsets.numpy(), bits(values)) > 0]
