"""Compiled (numba) kernels of the hot per-element loops, and the additive digest's arithmetic.

Layout: `X_jit.py` holds the numba code computing X and is imported on first use (numba costs
~0.3 s to import and is optional); `X.py`, where there is one, is the numpy/torch side: it
decides whether the kernel takes its inputs, makes the numpy views and, for `digest`, holds the
torch reference. The other references (the numpy codecs, the torch scatter and scan) sit beside
their call in the caller, which runs one or the other: each kernel is tested equal to its reference.
Every kernel is decorated by `jit.kernel` (numba, cached on disk where it can be). `switch.on()` is
the one switch (`VLLM_DELTA_KERNELS=0` turns every kernel off), and `warmup.warm_up()` compiles them
ahead of a first sync.

This package imports no other part of vllm_delta but `settings`: wire, engine and sender build on it.
"""
