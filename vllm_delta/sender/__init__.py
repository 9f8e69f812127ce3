"""The sender: any trainer hands over its HF-named weights (whole, or this rank's shards) after a step
(docs/architecture.md lists its modules)."""

from vllm_delta.sender.delta_sender import DeltaSender
from vllm_delta.sender.planner import EngineState, Plan
from vllm_delta.sender.shards import Shard

__all__ = ["DeltaSender", "EngineState", "Plan", "Shard"]
