"""The sender: any trainer hands over its HF-named weights (whole, or this rank's shards) after a step.

Cut along its seams: `planner` (who gets a delta, a catch-up or an anchor), `producer` (the scan:
diff, gather, digest, staging, where the parameters live), `publisher` (encode, move, seal, push,
acks), `ranks` (multi-rank plumbing), `shards` (where a rank's elements sit in the HF tensor), and
`delta_sender` (`DeltaSender`, which ties them together with capture/publish).
"""

from vllm_delta.sender.delta_sender import DeltaSender
from vllm_delta.sender.planner import EngineState, Plan
from vllm_delta.sender.shards import Shard

__all__ = ["DeltaSender", "EngineState", "Plan", "Shard"]
