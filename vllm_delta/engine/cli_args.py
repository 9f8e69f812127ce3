"""`vllm.cli_args_plugins` entry point: the delta flags of `vllm serve`, exported and checked as they are
parsed (the API server starts the engines before any route plugin runs; argparse has no post-parse hook,
so `check_after_parsing` wraps `parse_known_args`). The route plugin checks again.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_delta import settings
from vllm_delta.backend_names import is_ours

if TYPE_CHECKING:
    from vllm_delta.transports.store import StoreURL

WORKER_EXTENSION = "vllm_delta.engine.worker.DeltaWorkerExtension"
ENV_FLAG = settings.UPDATES
PLUGIN_NAME = "delta_updates"
DEFAULT_MAX_STAGED_BYTES = 256 << 20
# A collective update's body carries its manifest (about 200 B a changed tensor).
DEFAULT_MAX_BODY_BYTES = 64 << 20


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the "delta updates" argument group to the `vllm serve` parser."""
    group = parser.add_argument_group(
        "delta updates", "Apply sparse weight deltas in place through POST /update_weights_delta."
    )
    group.add_argument(
        "--enable-delta-updates", action="store_true",
        help="Serve /update_weights_delta and /delta_updates/status; needs --delta-updates-root.",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-root", type=delta_root, metavar="DIR|s3://BUCKET/PREFIX",
        help="The one directory (or s3:// prefix; AWS credentials from the environment) to read deltas from.",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-max-staged-bytes", type=positive_int, default=DEFAULT_MAX_STAGED_BYTES, metavar="N",
        help="The bound on everything one update stages, in bytes; a larger update is refused (413).",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-chunk-bytes", type=positive_int, dest="delta_updates_max_staged_bytes", metavar="N",
        action=DeprecatedAlias, default=argparse.SUPPRESS,
        help="Deprecated alias of --delta-updates-max-staged-bytes; removed in the next release.",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
        help="The largest request body the delta routes read; larger ones get 413.",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-collective-trainers", type=trainer_address, nargs="+", metavar="ADDR",
        help="Allow collective updates from trainers at these IP addresses, networks (CIDR) or host names.",
    )  # fmt: skip
    keys = group.add_mutually_exclusive_group()
    keys.add_argument(
        "--delta-updates-signing-key", nargs="+", metavar="KEY",
        help="Apply only manifests signed with one of these keys (docs/security.md); prefer the file.",
    )  # fmt: skip
    keys.add_argument(
        "--delta-updates-signing-key-file", metavar="FILE",
        help="The same, one key a line, read again for every update (rotate keys without a restart).",
    )  # fmt: skip
    group.add_argument(
        "--delta-updates-allow-seed-format", action="store_true",
        help="Also accept the seed's manifest-less deltas, with their weaker checks (docs/wire-format.md).",
    )  # fmt: skip
    check_after_parsing(parser)


class DeprecatedAlias(argparse.Action):
    """An old flag name: stores into its new flag's destination, with a warning naming the new flag."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = "--" + self.dest.replace("_", "-")
        message = f"{option_string} is deprecated and will be removed in the next release: use {new}"
        warnings.warn(message, FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def check_after_parsing(parser: argparse.ArgumentParser) -> None:
    """Export and check every namespace `parser` produces, a refusal being a usage error (`vllm serve`
    parses its subcommand through exactly this method, before it starts anything)."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, rest = parse(args, namespace)
        try:
            export(namespace)
            check_args(namespace)
            dp = getattr(namespace, "data_parallel_size", None) or 1  # one API server a DP rank, unless told
            one = getattr(namespace, "api_server_count", None) or getattr(namespace, "headless", False)
            if namespace.enable_delta_updates and dp > 1 and not one:
                raise ValueError(
                    f"--enable-delta-updates with --data-parallel-size {dp}: pass --api-server-count 1 "
                    f"(vLLM would start {dp} API servers, each with its own update lock and fault state)"
                )
            check_store(namespace)
        except ValueError as exc:
            parser.error(str(exc))
        return namespace, rest

    parser.parse_known_args = parse_known_args


def export(args: argparse.Namespace) -> None:
    """Our worker extension, and what the engine processes read (settings.py); our endpoint plugin
    allowlisted (it serves our route, and vLLM's weight routes for `delta`)."""
    if args.enable_delta_updates:
        args.worker_extension_cls = getattr(args, "worker_extension_cls", "") or WORKER_EXTENSION
        os.environ[ENV_FLAG] = "1"
    if args.delta_updates_root is not None:
        os.environ[settings.UPDATES_ROOT] = str(args.delta_updates_root)
    if args.enable_delta_updates or args.delta_updates_root is not None:
        os.environ["VLLM_PLUGINS"] = ",".join(plugin_allowlist(os.environ.get("VLLM_PLUGINS")))
    if args.delta_updates_allow_seed_format:
        os.environ[settings.ALLOW_SEED_FORMAT] = "1"
    keys, file = args.delta_updates_signing_key, args.delta_updates_signing_key_file
    if keys is None and file is None:
        return
    from vllm_delta.wire.signing import signing_keys

    flag = "--delta-updates-signing-key-file" if file else "--delta-updates-signing-key"
    if keys and any("," in k or k != k.strip() for k in keys):
        raise ValueError(f"{flag}: a key may not contain a comma or surrounding whitespace")
    os.environ.pop(settings.SIGNING_KEYS if file else settings.SIGNING_KEY_FILE, None)
    os.environ[settings.SIGNING_KEY_FILE if file else settings.SIGNING_KEYS] = (
        os.path.realpath(file) if file else ",".join(keys)
    )
    try:
        signing_keys(settings.signing_keys())  # the workers verify every manifest, through either door
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def plugin_allowlist(current: str | None) -> list[str]:
    """`VLLM_PLUGINS` with our name added. Endpoint plugins load only when named there, but setting it
    narrows every other plugin group to the names it lists: when unset, list every plugin that loads."""
    if current is not None:
        names = current.split(",")
    else:
        eps = entry_points()
        groups = [g for g in eps.groups if g.startswith("vllm.") and g != "vllm.endpoint_plugins"]
        names = sorted({ep.name for group in groups for ep in eps.select(group=group)})
    return names if PLUGIN_NAME in names else [*names, PLUGIN_NAME]


# Shared by both doors (this CLI check and the `delta` backend's worker engine).
TWO_DOORS_REFUSAL = (
    "the `delta` weight-transfer backend and --enable-delta-updates cannot serve the same engine: choose one"
)
EPLB_REFUSAL = (
    "delta updates cannot run with --enable-eplb: EPLB moves experts between slots while the engine "
    "serves, so the placement learned at startup would write into another expert's slot"
)
API_SERVERS_REFUSAL = (
    "{} cannot run with --api-server-count {}: each API server holds its own update lock, version and "
    "fault state, so two updates could interleave on the workers. Use --api-server-count 1."
)
# The load-balancing modes in which a server reaches only some DP engines (vllm/entrypoints/cli/serve.py).
DP_LB_FLAGS = ("external_lb", "hybrid_lb", "multi_port_external_lb", "rank", "start_rank")  # data_parallel_*
NATIVE_DP_REFUSAL = (
    "the `delta` weight-transfer backend cannot run with --data-parallel-size {}: vLLM 0.32's "
    "DPLBAsyncMPClient.call_utility_async answers with the first engine's replies only, so another "
    "replica's refusal would go unseen. Use --enable-delta-updates, which calls every DP engine."
)
ONLINE_QUANT_REFUSAL = (
    "delta updates cannot serve --quantization {q} of {model}, whose config.json has no "
    "quantization_config: vLLM quantizes it at load and keeps no bf16 copy, so no delta reproduces "
    "its scales (docs/results/fp8.md). Serve the bf16 checkpoint, or a block-fp8 one."
)


def check_args(args: argparse.Namespace) -> None:
    """Refuse a command line whose door (our route, or the `delta` backend) cannot serve updates safely."""
    ours, native = getattr(args, "enable_delta_updates", False), is_ours(weight_transfer_backend(args))
    if not ours and not native:
        return
    if ours and args.delta_updates_root is None:
        raise ValueError("--enable-delta-updates requires --delta-updates-root DIR")
    q = getattr(args, "quantization", None)
    model = getattr(args, "model_tag", None) or getattr(args, "model", None)
    config = Path(str(model)) / "config.json"  # a local checkpoint (a hub id is not read here)
    if q and config.is_file():
        cfg = json.loads(config.read_text())
        if not (cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")):
            raise ValueError(ONLINE_QUANT_REFUSAL.format(q=q, model=model))
    dp, servers = getattr(args, "data_parallel_size", None) or 1, getattr(args, "api_server_count", None) or 1
    if not ours:  # the backend's front end must reach every engine
        if dp > 1:
            raise ValueError(NATIVE_DP_REFUSAL.format(dp))
        if servers > 1:
            raise ValueError(API_SERVERS_REFUSAL.format("the `delta` weight-transfer backend", servers))
        return
    if args.worker_extension_cls != WORKER_EXTENSION:
        why = f"--enable-delta-updates installs --worker-extension-cls {WORKER_EXTENSION}"
        raise ValueError(f"{why}, not --worker-extension-cls {args.worker_extension_cls}")
    if native:
        raise ValueError(TWO_DOORS_REFUSAL)
    if servers > 1:
        raise ValueError(API_SERVERS_REFUSAL.format("--enable-delta-updates", servers))
    # With DP, only vLLM's internal load balancer lets our one API server reach every DP engine.
    given = [d for d in DP_LB_FLAGS if getattr(args, f"data_parallel_{d}", None) not in (None, False)]
    if dp > 1 and given:
        raise ValueError(
            f"--enable-delta-updates with --data-parallel-size {dp} needs vLLM's "
            f"internal load balancer, not --data-parallel-{given[0].replace('_', '-')}: each API server "
            "would reach only its own DP engines, so an update would leave other replicas on old weights"
        )
    if getattr(args, "enable_eplb", False):
        raise ValueError(EPLB_REFUSAL)
    if not api_keys(args) and not dev_mode() and not loopback_only(args):
        raise ValueError(
            "--enable-delta-updates lets whoever reaches this server rewrite its weights: give "
            "--api-key (or VLLM_API_KEY), listen on loopback only (--host 127.0.0.1, localhost "
            "or ::1), or set VLLM_SERVER_DEV_MODE=1"
        )


def check_store(args: argparse.Namespace) -> None:
    """Refuse a store root this server cannot read before any engine loads, not on a first sync."""
    from vllm_delta.transports.store import ObjectStore, StoreError, StoreURL

    root = args.delta_updates_root
    if not args.enable_delta_updates or not isinstance(root, StoreURL):
        return
    try:
        ObjectStore(root, max_concurrency=1, max_attempts=2).check_access()
    except StoreError as exc:
        raise ValueError(f"--delta-updates-root {root}: {type(exc).__name__}: {exc.reason}") from None


def weight_transfer_backend(args: argparse.Namespace) -> str | None:
    """`--weight-transfer-config`'s backend, as parsed (a dict or vLLM's config object) or None."""
    config = getattr(args, "weight_transfer_config", None)
    return config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys vLLM's own middleware accepts: `--api-key`, else `VLLM_API_KEY`."""
    from vllm import envs

    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


def dev_mode() -> bool:
    """vLLM's development mode, in which it serves its own weight routes unauthenticated."""
    from vllm import envs

    return bool(envs.VLLM_SERVER_DEV_MODE)


def loopback_only(args: argparse.Namespace) -> bool:
    """Whether the server listens on a Unix socket or a loopback address only (no `--host`: all)."""
    host = getattr(args, "host", None)
    if getattr(args, "uds", None) or (host or "").lower() == "localhost":
        return True
    try:
        return bool(host) and ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def trainer_address(value: str) -> str:
    """An IP address, a network (CIDR) or a host name a trainer's `master_addr` may have."""
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        if not value or any(c.isspace() or c in "/,@:" for c in value):
            raise argparse.ArgumentTypeError(
                f"{value!r} is not an IP address, network or host name"
            ) from None
    return value


def delta_root(value: str) -> Path | StoreURL:
    """An `s3://BUCKET[/PREFIX]` store root, else an existing directory, resolved (containment compares)."""
    from vllm_delta.transports.store import StoreURL, is_store_url

    if not is_store_url(value):
        if not (path := Path(os.path.realpath(value))).is_dir():
            raise argparse.ArgumentTypeError(f"{value!r} is not an existing directory")
        return path
    try:
        return StoreURL.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(value: str) -> int:
    number = int(value)  # a ValueError: argparse's "invalid positive_int value"
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be positive")
    return number
