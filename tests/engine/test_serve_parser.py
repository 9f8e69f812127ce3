"""`vllm serve` command lines that enable delta updates: refused or accepted while they are parsed.

Why in-process: the refusals happen in `vllm serve`'s own parser (vLLM's `make_arg_parser`, with our
`vllm.cli_args_plugins` hook wrapping its `parse_known_args`) before anything starts, so running that
parser here checks exactly what the real command checks, without starting an engine.
"""

from __future__ import annotations

import json
import os

import pytest
from harness.s3_server import s3_env, s3_server  # noqa: F401  (fixtures: a real local store)

from vllm_delta import settings
from vllm_delta.engine import cli_args
from vllm_delta.settings import ALLOW_SEED_FORMAT as SEED_ENV
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV


@pytest.fixture
def serve_parser(monkeypatch):
    """`parse(*argv)`: `vllm serve`'s parser on `model *argv`, with no dev mode and no key in the
    environment."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The parser sets the delta flags in os.environ (for the engine it starts): setenv first, so
    # monkeypatch restores each name to its state before the test, unset included.
    for name in (
        "VLLM_SERVER_DEV_MODE",
        "VLLM_API_KEY",
        cli_args.ENV_FLAG,
        ROOT_ENV,
        "VLLM_PLUGINS",
        settings.SIGNING_KEYS,
        settings.SIGNING_KEY_FILE,
        SEED_ENV,
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def parse(*argv: str):
        return make_arg_parser(FlexibleArgumentParser()).parse_args(["model", *argv])

    return parse


@pytest.fixture
def delta_flags(tmp_path) -> list[str]:
    return ["--enable-delta-updates", "--delta-updates-root", str(tmp_path)]


REFUSED = {
    "no-key-all-interfaces": ([], {}, "give --api-key (or VLLM_API_KEY), listen on loopback only"),
    "no-key-0.0.0.0": (["--host", "0.0.0.0"], {}, "lets whoever reaches this server"),
    "no-key-host-name": (["--host", "engine-0.internal"], {}, "lets whoever reaches this server"),
    "dev-mode-0": (["--host", "::"], {"VLLM_SERVER_DEV_MODE": "0"}, "or set VLLM_SERVER_DEV_MODE=1"),
    "api-server-count": (["--api-key", "k", "--api-server-count", "2"], {}, "--api-server-count 2"),
    "data-parallel": (["--api-key", "k", "--data-parallel-size", "2"], {}, "--data-parallel-size 2"),
    "eplb": (["--api-key", "k", "--enable-eplb"], {}, "--enable-eplb"),
    "bad-trainer": (["--api-key", "k", "--delta-updates-collective-trainers", "a b"], {}, "host name"),
    "two-doors": (
        ["--api-key", "k", "--weight-transfer-config", '{"backend": "delta"}'],
        {},
        "cannot serve the same engine: choose one",
    ),
}


NATIVE_REFUSED = {
    "data-parallel": (
        ["--data-parallel-size", "2", "--api-server-count", "1"],
        "DPLBAsyncMPClient.call_utility_async",
    ),
    "api-server-count": (
        ["--api-server-count", "2"],
        "the `delta` weight-transfer backend cannot run with --api-server-count 2",
    ),
}


@pytest.mark.parametrize("case", NATIVE_REFUSED)
def test_the_native_backend_is_refused_where_its_front_end_misses_engines(serve_parser, capsys, case):
    flags, message = NATIVE_REFUSED[case]
    with pytest.raises(SystemExit) as exc:
        serve_parser("--weight-transfer-config", '{"backend": "delta"}', *flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_native_backend_parses_on_one_engine(serve_parser):
    args = serve_parser("--weight-transfer-config", '{"backend": "delta"}')
    assert cli_args.weight_transfer_backend(args) == "delta"


@pytest.mark.parametrize("case", REFUSED)
def test_unsafe_command_lines_are_refused_at_parse_time(serve_parser, delta_flags, monkeypatch, capsys, case):
    flags, env, message = REFUSED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        serve_parser(*delta_flags, *flags)
    assert exc.value.code == 2  # argparse's usage error: what `vllm serve` exits with
    assert message in capsys.readouterr().err


def test_the_flag_without_a_root_is_refused(serve_parser, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_parser("--enable-delta-updates", "--api-key", "k")
    assert exc.value.code == 2
    assert "--enable-delta-updates requires --delta-updates-root DIR" in capsys.readouterr().err


ALLOWED = {
    "api-key": (["--api-key", "k"], {}),
    "api-key-env": (["--host", "0.0.0.0"], {"VLLM_API_KEY": "k"}),
    "dev-mode": (["--host", "0.0.0.0"], {"VLLM_SERVER_DEV_MODE": "1"}),
    "loopback-v4": (["--host", "127.0.0.1"], {}),
    "loopback-v4-net": (["--host", "127.3.2.1"], {}),
    "loopback-v6": (["--host", "::1"], {}),
    "localhost": (["--host", "localhost"], {}),
    "unix-socket": (["--uds", "/tmp/vllm-delta-test.sock"], {}),
}


@pytest.mark.parametrize("case", ALLOWED)
def test_safe_command_lines_parse(serve_parser, delta_flags, monkeypatch, case):
    flags, env = ALLOWED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = serve_parser(
        *delta_flags, *flags, "--delta-updates-collective-trainers", "10.0.0.0/8", "::1", "trainer-0"
    )
    assert args.enable_delta_updates and args.delta_updates_max_body_bytes == cli_args.DEFAULT_MAX_BODY_BYTES
    assert args.delta_updates_collective_trainers == ["10.0.0.0/8", "::1", "trainer-0"]


def test_seed_format_is_off_unless_the_operator_allows_it(serve_parser, delta_flags):
    """The workers read the choice from the environment the parser sets (settings.allow_seed_format)."""
    assert not serve_parser(*delta_flags, "--api-key", "k").delta_updates_allow_seed_format
    assert not settings.allow_seed_format()
    assert serve_parser(*delta_flags, "--api-key", "k", "--delta-updates-allow-seed-format")
    assert settings.allow_seed_format()


def test_flag_off_parses_as_stock_vllm(serve_parser):
    args = serve_parser("--host", "0.0.0.0")
    assert not args.enable_delta_updates and args.worker_extension_cls != cli_args.WORKER_EXTENSION


def test_a_store_root_parses_after_one_access_check(serve_parser, s3_env):
    url = s3_env.url("serve")
    args = serve_parser("--enable-delta-updates", "--delta-updates-root", f"{url}/", "--api-key", "k")
    assert str(args.delta_updates_root) == url  # normalized: no trailing "/"
    assert os.environ[ROOT_ENV] == url  # what the workers read; no local path was made of it


STORE_REFUSED = {
    "no-bucket": ("s3://", {}, "not an s3://BUCKET[/PREFIX] URL"),
    "no-bucket-prefix": ("s3:///prefix", {}, "not an s3://BUCKET[/PREFIX] URL"),
    "dotdot-prefix": ("s3://bucket/a/../b", {}, "'..' segment"),
    "wrong-secret": (None, {"AWS_SECRET_ACCESS_KEY": "not-the-secret-1234"}, "StoreAuthError: the store at"),
    "missing-bucket": ("s3://no-such-bucket-here/p", {}, "StoreNotFound: no such bucket"),
}


@pytest.mark.parametrize("case", STORE_REFUSED)
def test_a_bad_store_root_is_refused_at_parse_time(serve_parser, s3_env, monkeypatch, capsys, case):
    url, env, message = STORE_REFUSED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        serve_parser(
            "--enable-delta-updates", "--delta-updates-root", url or s3_env.url("serve"), "--api-key", "k"
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert s3_env.secret_key not in err and "not-the-secret-1234" not in err  # secrets never printed


def test_the_staging_bound_flag_and_its_deprecated_alias(serve_parser, delta_flags):
    """`--delta-updates-max-staged-bytes` sets the bound; the old `--delta-updates-chunk-bytes` still
    does, for one release, with a warning naming the new flag."""
    flags = [*delta_flags, "--api-key", "k"]
    assert serve_parser(*flags).delta_updates_max_staged_bytes == cli_args.DEFAULT_MAX_STAGED_BYTES
    assert (
        serve_parser(*flags, "--delta-updates-max-staged-bytes", "4096").delta_updates_max_staged_bytes
        == 4096
    )
    with pytest.warns(FutureWarning, match="--delta-updates-max-staged-bytes"):
        args = serve_parser(*flags, "--delta-updates-chunk-bytes", "8192")
    assert args.delta_updates_max_staged_bytes == 8192 and not hasattr(args, "delta_updates_chunk_bytes")


KEY_A, KEY_B = "a" * 16, "b" * 32


def test_signing_keys_are_exported_to_the_engine_processes(serve_parser, delta_flags, tmp_path):
    """Both doors' workers read the keys from the environment the parser sets (wire/signing.py)."""
    args = serve_parser(*delta_flags, "--api-key", "k", "--delta-updates-signing-key", KEY_A, KEY_B)
    assert args.delta_updates_signing_key == [KEY_A, KEY_B]
    assert settings.signing_keys() == [KEY_A, KEY_B] and settings.SIGNING_KEY_FILE not in os.environ
    keys = tmp_path / "keys"
    keys.write_text(f"# comment\n{KEY_B}\n")
    native = ["--weight-transfer-config", '{"backend": "delta"}', "--delta-updates-root", str(tmp_path)]
    serve_parser(*native, "--delta-updates-signing-key-file", str(keys))
    assert os.environ[settings.SIGNING_KEY_FILE] == str(keys.resolve()) and settings.signing_keys() == [KEY_B]
    assert settings.SIGNING_KEYS not in os.environ


SIGNING_REFUSED = {
    "short": (["--delta-updates-signing-key", KEY_A, "short"], "key #2 is shorter than 16 bytes"),
    "twice": (["--delta-updates-signing-key", KEY_A, KEY_A], "listed twice"),
    "comma": (["--delta-updates-signing-key", KEY_A + "," + KEY_B], "comma"),
    "no-file": (["--delta-updates-signing-key-file", "/nonexistent/keys"], "No such file"),
    "empty-file": (["--delta-updates-signing-key-file", "/dev/null"], "lists no key"),
    "both": (["--delta-updates-signing-key", KEY_A, "--delta-updates-signing-key-file", "k"], "not allowed"),
}


@pytest.mark.parametrize("case", SIGNING_REFUSED)
def test_bad_signing_keys_are_refused_at_parse_time_without_printing_them(
    serve_parser, delta_flags, capsys, case
):
    flags, message = SIGNING_REFUSED[case]
    with pytest.raises(SystemExit) as exc:
        serve_parser(*delta_flags, "--api-key", "k", *flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and KEY_A not in err


@pytest.mark.parametrize("quantized", [False, True])
def test_online_quantization_is_refused_at_parse_time(serve_parser, tmp_path, capsys, quantized):
    """`--quantization fp8` on a bf16 checkpoint is quantized by vLLM at load (one scale per fused layer,
    no bf16 kept): refused, with why, through both doors. A checkpoint that is already quantized parses."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = tmp_path / "model"
    model.mkdir()
    config = (
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}} if quantized else {}
    )
    (model / "config.json").write_text(json.dumps(config))
    doors = (
        ["--enable-delta-updates", "--delta-updates-root", str(tmp_path), "--api-key", "k"],
        ["--weight-transfer-config", '{"backend": "delta"}'],
    )
    for door in doors:
        argv = [str(model), "--quantization", "fp8", *door]
        if quantized:
            assert make_arg_parser(FlexibleArgumentParser()).parse_args(argv).quantization == "fp8"
            continue
        with pytest.raises(SystemExit) as exc:
            make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "cannot serve --quantization fp8" in err and "keeps no bf16" in err, (
            err
        )
