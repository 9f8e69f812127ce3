"""Compiled (numba) kernels of the hot per-element loops, and the additive digest's arithmetic.

`X_jit.py` holds the numba code computing X, imported on first use (numba costs ~0.3 s to import and
is optional); `X.py`, where there is one, decides whether the kernel takes its inputs and holds the
torch reference (docs/architecture.md). This package imports no other part of vllm_delta but `settings`.
"""
