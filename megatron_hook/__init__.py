"""Megatron-core integration: a post-optimizer-step hook that diffs shard-local weights in HF coordinates."""
