"""Compiled (numba) kernels of the hot per-element loops, each `X_jit.py` beside its torch reference `X.py`
(docs/architecture.md); it imports nothing of vllm_delta but `settings`."""
