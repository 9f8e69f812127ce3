"""vllm-delta: bit-exact delta weight sync between RL trainers and vLLM engines. It imports without vLLM
(trainers use `wire` and `sender`); `vllm_delta.engine` imports vLLM lazily."""

__version__ = "0.1.0"

__all__ = ["DeltaSender", "DeltaTrainerInitInfo"]


def __getattr__(name: str):
    # Lazy: `import vllm_delta` stays light (no aiohttp) for code that only needs the codec.
    if name == "DeltaSender":
        from vllm_delta.sender import DeltaSender

        return DeltaSender
    if name == "DeltaTrainerInitInfo":  # the `delta` backend of vLLM's weight-transfer API (needs vLLM)
        from vllm_delta.weight_transfer.trainer import DeltaTrainerInitInfo

        return DeltaTrainerInitInfo
    raise AttributeError(f"module 'vllm_delta' has no attribute {name!r}")
