"""The receiver's per-change work on CPU weights as compiled loops: the commit's scatter and
read-back, and prepare's digests of the changed positions with the ULP resolve.

Why: the torch path (the reference these are tested equal to, tests/engine/test_apply_kernel.py)
costs ~74 ns a change on one CPU thread: int32 -> int64 offset copies, `index_copy_`, a gathered
copy of every written value for the read-back, and ~30 elementwise int64 passes for the digest
terms. Each loop here reads and writes each entry once (engine/apply_jit.py). The read-back stays
its own pass over the live weights after the writes, in its own compiled function, so it checks
the write instead of repeating it.

numba is optional (a vLLM dependency; the `cpu-scan` extra): without it, off the CPU, for a dtype
conversion in the same step, or with `VLLM_DELTA_APPLY_KERNEL=0` (A/B runs, tests), the torch path runs.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_delta.wire.codecs import HAVE_NUMBA
from vllm_delta.wire.codecs import apply_kernel_on as enabled  # the one switch of the receiver's kernels

# Empty stand-ins of the usual types (int32 offsets, int64 slots): no compiled variant of their own.
_NO_OFFSETS, _NO_SLOTS = np.empty(0, np.int32), np.empty(0, np.int64)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on the CPU (a mixed-device call goes the torch
    way, which refuses it), and switched on."""
    return enabled() and all(t.device.type == "cpu" for t in tensors)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as an unsigned numpy view (no copy)."""
    return t.detach().reshape(-1).view(_SIGNED[t.element_size()]).numpy().view(_UINT[t.element_size()])


def _kind(dtype: torch.dtype) -> int | None:
    """How `apply_jit._resolve` keys this dtype (wire.codecs.order_key), or None: not resolved here."""
    from vllm_delta.engine import apply_jit as J

    if dtype.itemsize > 4 or dtype == torch.bool:
        return None
    if dtype.is_floating_point:
        return J.FLOAT
    return J.UNSIGNED if dtype == torch.uint8 else J.SIGNED if dtype in (torch.int8, torch.int16, torch.int32) else None


def scatter(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, base: torch.dtype | None) -> torch.Tensor | None:
    """`apply.scatter` on CPU tensors: writes the chunk, returns the values written (flat's dtype),
    or None where the kernel does not apply (a dtype conversion, a step in another dtype)."""
    if base is None:
        if values.dtype != flat.dtype:
            return None
        from vllm_delta.engine.apply_jit import write

        write(_bits(flat), offsets.numpy(), _bits(values))
        return values
    kind = _kind(base)
    if base != flat.dtype or kind is None or values.element_size() != flat.element_size():
        return None
    from vllm_delta.engine.apply_jit import write_resolved

    out = torch.empty(values.numel(), dtype=flat.dtype)
    write_resolved(_bits(flat), offsets.numpy(), _bits(values), kind, _bits(out))
    return out


_FLAG = (torch.tensor(False), torch.tensor(True))  # what `missed` answers: no tensor made per block


def missed(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A bool tensor: some live flat[offsets] differ bitwise from `values` (read after the writes)."""
    from vllm_delta.engine.apply_jit import mismatches

    return _FLAG[mismatches(_bits(flat), offsets.numpy(), _bits(values)) > 0]


def stage_sums(flat: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
               slots: torch.Tensor | int, n: int, dtype: torch.dtype, needs_base: bool, pre: bool,
               post: bool) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """int64[n, 2] lane sums per slot of the old values at `offsets` (pre) and of the new ones (post;
    ULP steps resolved on the old), as `batched.slot_sums` gives them; None where the kernel does not
    apply (the old values need a cast to `dtype`, a 64-bit dtype, or non-CPU tensors)."""
    gather = pre or needs_base
    slot_t = slots if isinstance(slots, torch.Tensor) else None
    if not takes(flat, offsets, positions, values, *([slot_t] if slot_t is not None else [])):
        return None
    if values.element_size() > 4 or (gather and flat.dtype != dtype) or dtype.itemsize > 4:
        return None
    kind = _kind(dtype) if needs_base else -1
    if kind is None:
        return None
    from vllm_delta.engine.apply_jit import slot_sums

    vals = _bits(values)
    sums = slot_sums(positions.numpy(), _bits(flat) if gather else vals,
                     offsets.numpy() if gather else _NO_OFFSETS,
                     vals, slot_t.numpy() if slot_t is not None else _NO_SLOTS,
                     0 if slot_t is not None else int(slots), n, pre, post, kind)
    out = torch.from_numpy(sums.view(np.int64))
    return (out[0] if pre else None, out[1] if post else None)
