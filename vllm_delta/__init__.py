"""vllm-delta: bit-exact delta weight sync between RL trainers and vLLM engines.

This package imports without vLLM: trainers use its codec (`vllm_delta.wire`) and sender.
Engine-side code lives in `vllm_delta.engine` and imports vLLM lazily.
"""

__version__ = "0.1.0"
