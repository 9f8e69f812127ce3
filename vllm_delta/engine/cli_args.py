"""`vllm.cli_args_plugins` entry point: the `--enable-delta-updates` flags of `vllm serve`.

Why an argparse Action: the flag has to take effect while the command line is parsed. The API
server turns the parsed args into engine args and starts the engine processes before any route
plugin runs, so the worker extension and the environment the workers read are set here.
Argparse has no post-parse hook, so what can only be judged on the whole command line (the root
is given, no later `--worker-extension-cls` replaced ours) is checked by `check_args`, which the
route plugin calls when the app is built.
"""

from __future__ import annotations

import argparse
import os
from importlib.metadata import entry_points
from pathlib import Path

WORKER_EXTENSION = "vllm_delta.engine.worker.DeltaWorkerExtension"
ENV_FLAG = "VLLM_DELTA_UPDATES"
PLUGIN_NAME = "delta_updates"
ENDPOINT_GROUP = "vllm.endpoint_plugins"
DEFAULT_CHUNK_BYTES = 256 << 20


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the "delta updates" argument group to the `vllm serve` parser."""
    group = parser.add_argument_group(
        "delta updates", "Apply sparse weight deltas in place through POST /update_weights_delta."
    )
    group.add_argument(
        "--enable-delta-updates", action=EnableDeltaUpdates,
        help="Serve /update_weights_delta and /delta_updates/status; needs --delta-updates-root.",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-root", type=existing_dir, default=None, metavar="DIR", action=DeltaUpdatesRoot,
        help="The only directory deltas may be read from (also by the `delta` weight-transfer backend).",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-chunk-bytes", type=positive_int, default=DEFAULT_CHUNK_BYTES, metavar="N",
        help="The receiver's working-set cap per apply chunk, in bytes.",
    )  # fmt: skip


class EnableDeltaUpdates(argparse.Action):
    """Turn delta updates on: our worker extension, the workers' env flag, our route allowlisted."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, "worker_extension_cls", "")
        if current and current != WORKER_EXTENSION:
            parser.error(f"--enable-delta-updates installs --worker-extension-cls {WORKER_EXTENSION}; "
                         f"it cannot be combined with --worker-extension-cls {current}")
        namespace.worker_extension_cls = WORKER_EXTENSION
        setattr(namespace, self.dest, True)
        os.environ[ENV_FLAG] = "1"
        os.environ["VLLM_PLUGINS"] = ",".join(plugin_allowlist(os.environ.get("VLLM_PLUGINS")))


class DeltaUpdatesRoot(argparse.Action):
    """Store the root and export it to the engine processes, where the `delta` weight-transfer
    backend (`--weight-transfer-config '{"backend": "delta"}'`) reads it; allowlist our endpoint
    plugin, which answers vLLM's weight routes for that backend."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from vllm_delta.native import ROOT_ENV

        setattr(namespace, self.dest, values)
        os.environ[ROOT_ENV] = str(values)
        os.environ["VLLM_PLUGINS"] = ",".join(plugin_allowlist(os.environ.get("VLLM_PLUGINS")))


def plugin_allowlist(current: str | None) -> list[str]:
    """`VLLM_PLUGINS` with our name added, loading every other plugin exactly as before.

    Endpoint plugins load only when named in `VLLM_PLUGINS`, but setting it narrows every other
    plugin group to the names it lists. When it is unset, list every plugin that would load anyway.
    """
    if current is not None:
        names = current.split(",")
    else:
        eps = entry_points()
        names = sorted({ep.name for group in eps.groups if group.startswith("vllm.") and group != ENDPOINT_GROUP
                        for ep in eps.select(group=group)})
    return names if PLUGIN_NAME in names else [*names, PLUGIN_NAME]


def check_args(args: argparse.Namespace) -> None:
    """Refuse a command line that enabled delta updates but cannot serve them."""
    if not getattr(args, "enable_delta_updates", False):
        return
    if args.delta_updates_root is None:
        raise ValueError("--enable-delta-updates requires --delta-updates-root DIR")
    if args.worker_extension_cls != WORKER_EXTENSION:
        raise ValueError(f"--enable-delta-updates installs --worker-extension-cls {WORKER_EXTENSION}; "
                         f"it cannot be combined with --worker-extension-cls {args.worker_extension_cls}")


def existing_dir(value: str) -> Path:
    """An existing directory, fully resolved (so later containment checks compare real paths)."""
    path = Path(os.path.realpath(value))
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is not an existing directory")
    return path


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be positive")
    return number
