"""Test-only post-load steps for real engines: names only (the patch is in `post_load_steps_worker`).

Why two modules: importing the worker module patches vLLM's linear method, which must happen
in the engines' workers only, never in the test process.
"""

EXTENSION = "harness.post_load_steps_worker.StepsWorkerExtension"
PERMUTED = "layers.0.self_attn.qkv_proj"  # its step swaps the halves of the weight rows
DERIVED = "layers.1.self_attn.o_proj"  # its step derives W_T, which its forward uses
