"""Megatron-core integration: a post-optimizer-step hook that diffs shard-local weights in HF coordinates:
`handle = megatron_hook.register(optimizer, model_chunks, sender, bridge=bridge, checkpoint=hf_dir)`."""

from megatron_hook.hook import HookHandle, RebindError, SeedMismatchError, SeedReport, register

__all__ = ["HookHandle", "RebindError", "SeedMismatchError", "SeedReport", "register"]
