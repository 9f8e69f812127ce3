"""Test-only helpers: tiny model fixtures, real vLLM engines, megatron-core on CPU."""
