"""`delta` as a backend of vLLM's own weight-transfer framework (`vllm.distributed.weight_transfer`).

Why: RL frameworks drive weight sync through vLLM's registries, routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`), clients and `LLM` methods.
Registered there, delta sync needs no client of ours. Worker side: `worker_engine` runs the same
prepare/commit as `POST /update_weights_delta` (update = prepare, finish = commit). Trainer side:
`trainer` drives a `DeltaSender` through any `VLLMWeightSyncClient`. `registry` registers both from
the `vllm.general_plugins` entry point, so a plain `pip install` is enough.
"""

BACKEND = "delta"
# The only directory the `delta` backend reads deltas from, as the engine processes see it.
# `--delta-updates-root` exports it; without the CLI patch, set it in the environment.
ROOT_ENV = "VLLM_DELTA_UPDATES_ROOT"
