"""`delta` as a backend of vLLM's own weight-transfer framework (`vllm.distributed.weight_transfer`).

Why: RL frameworks drive weight sync through vLLM's registries, routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`), clients and `LLM` methods.
Registered there, delta sync needs no client of ours. This package is a door over the engine's
transaction core (engine/transaction.py), beside our own route: `routes` is the HTTP front end,
`worker_engine` the worker half (and the offline `LLM`'s whole update), `trainer` and `links` the
trainer half driving a `DeltaSender`, and `registry` registers both halves from the
`vllm.general_plugins` entry point, so a plain `pip install` is enough.
"""
