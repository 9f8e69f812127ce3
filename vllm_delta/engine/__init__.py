"""vLLM side of vllm-delta: the plugin's doors, the transaction core, the worker side, placement and apply."""
