"""`delta` as a backend of vLLM's own weight-transfer framework (`vllm.distributed.weight_transfer`).

Why: RL frameworks drive weight sync through vLLM's registries, routes, clients and `LLM` methods;
registered there (`registry`, from our general plugin), delta sync needs no client of ours. A door
over the engine's transaction core beside our own route (docs/architecture.md).
"""
