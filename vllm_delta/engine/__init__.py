"""vLLM side of vllm-delta: plugin entry points, HTTP routes, worker method, placement and apply.

Only this subpackage imports vLLM, and it does so lazily inside functions where it can.
"""
