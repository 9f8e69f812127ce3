"""Test-only post-load steps for real engines: names only (the patch is in `post_load_steps_worker`).

Why two modules: importing the worker module patches vLLM's linear method, which must happen
in the engines' workers only, never in the test process.
"""

EXTENSION = "harness.post_load_steps_worker.StepsWorkerExtension"
PERMUTED = "layers.0.self_attn.qkv_proj"  # its step swaps the halves of the weight rows
DERIVED = "layers.1.self_attn.o_proj"  # its step derives W_T, which its forward uses
# Its fused experts' conversion swaps the w13 halves (FlashInfer-CUTLASS). Layer 0 is a MoE layer in
# qwen3_moe only (glm4_moe's is dense: first_k_dense_replace), so glm4_moe keeps its one MoE layer prepacked.
MOE_PERMUTED = "layers.0.mlp.experts"  # the experts' `layer_name`; vLLM's module is its `.routed_experts`
MOE_PERMUTED_MODULE = f"{MOE_PERMUTED}.routed_experts"
