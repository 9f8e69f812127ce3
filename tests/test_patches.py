"""The vLLM patch applier (idempotent, version-gated) and the `vllm serve` flags the patch enables."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_delta.engine import cli_args
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV

PATCHES = Path(__file__).resolve().parents[1] / "patches"
PATCHED_FILE = Path("vllm/entrypoints/launchers/cli_args.py")


@pytest.fixture(scope="module")
def apply_mod():
    spec = importlib.util.spec_from_file_location("patches_apply", PATCHES / "apply.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stock_vllm(apply_mod, tmp_path, monkeypatch) -> Path:
    """A copy of the installed vLLM file the patch touches, unpatched, as the site-packages to patch."""
    target = tmp_path / PATCHED_FILE
    target.parent.mkdir(parents=True)
    shutil.copy(apply_mod.site_packages() / PATCHED_FILE, target)
    for patch_file in sorted(PATCHES.glob("*.patch")):
        if apply_mod.is_applied(patch_file, tmp_path):
            subprocess.run(
                ["patch", "-p1", "-R", "--batch", "--silent", "-d", str(tmp_path), "-i", str(patch_file)],
                check=True,
            )
    monkeypatch.setattr(apply_mod, "site_packages", lambda: tmp_path)
    return target


def run(apply_mod, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["apply.py", *argv])
    return apply_mod.main()


def test_apply_is_idempotent_and_checkable(apply_mod, stock_vllm, monkeypatch, capsys):
    assert "vllm.cli_args_plugins" not in stock_vllm.read_text()
    assert run(apply_mod, monkeypatch, "--check") == 1
    assert run(apply_mod, monkeypatch) == 0
    patched = stock_vllm.read_text()
    assert 'load_plugins_by_group("vllm.cli_args_plugins")' in patched
    assert run(apply_mod, monkeypatch) == 0
    assert stock_vllm.read_text() == patched, "re-applying changed the file"
    assert run(apply_mod, monkeypatch, "--check") == 0
    out = capsys.readouterr().out
    assert "NOT applied" in out and "applied now" in out and out.count("applied now") == 1


def test_refuses_an_unknown_vllm_version(apply_mod, stock_vllm, monkeypatch, capsys):
    before = stock_vllm.read_text()
    monkeypatch.setattr(apply_mod, "installed_vllm_version", lambda: "0.33.0")
    assert run(apply_mod, monkeypatch) == 2
    assert "refusing to patch vLLM 0.33.0" in capsys.readouterr().err
    assert stock_vllm.read_text() == before


def test_refuses_a_file_it_does_not_fit(apply_mod, stock_vllm, monkeypatch, capsys):
    stock = stock_vllm.read_text()
    start = stock.index("    parser = FrontendArgs.add_cli_args(parser)")
    stock_vllm.write_text(
        stock[:start] + "    return build_parser(parser)\n" + stock[stock.index("\n\n\ndef ", start) :]
    )
    before = stock_vllm.read_text()
    assert run(apply_mod, monkeypatch) == 1
    assert "does not apply" in capsys.readouterr().err
    assert stock_vllm.read_text() == before


def test_installed_vllm_is_patched(apply_mod, monkeypatch):
    assert run(apply_mod, monkeypatch, "--check") == 0, "run `make install` (or `python patches/apply.py`)"


@pytest.fixture
def clean_env(monkeypatch):
    """The flag writes the process environment: start with its names unset (tests/conftest.py's
    autouse fixture gives them back after the test)."""
    for name in (cli_args.ENV_FLAG, "VLLM_PLUGINS", ROOT_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def flags_parser() -> argparse.ArgumentParser:
    """Our flags beside the vLLM flags `check_args` reads, with vLLM's defaults (no --host: every
    interface)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--worker-extension-cls", default="")
    parser.add_argument("--host", default=None)
    parser.add_argument("--api-key", nargs="+", default=None)
    cli_args.add_cli_args(parser)
    return parser


def test_flag_off_changes_nothing(clean_env):
    args = flags_parser().parse_args([])
    assert not args.enable_delta_updates and args.worker_extension_cls == ""
    cli_args.check_args(args)
    assert cli_args.ENV_FLAG not in os.environ and "VLLM_PLUGINS" not in os.environ


def test_flag_on_sets_extension_env_and_allowlist(clean_env, tmp_path):
    args = flags_parser().parse_args(
        [
            "--enable-delta-updates",
            "--delta-updates-root",
            str(tmp_path),
            "--delta-updates-max-staged-bytes",
            "4096",
            "--host",
            "127.0.0.1",
        ]
    )
    assert args.worker_extension_cls == cli_args.WORKER_EXTENSION
    assert args.delta_updates_root == tmp_path.resolve() and args.delta_updates_max_staged_bytes == 4096
    assert os.environ[cli_args.ENV_FLAG] == "1"
    allowed = os.environ["VLLM_PLUGINS"].split(",")
    assert cli_args.PLUGIN_NAME in allowed
    cli_args.check_args(args)


def test_allowlist_keeps_every_other_plugin():
    assert cli_args.plugin_allowlist("a,b") == ["a", "b", "delta_updates"]
    assert cli_args.plugin_allowlist("delta_updates") == ["delta_updates"]
    unset = cli_args.plugin_allowlist(None)
    assert "delta_updates" in unset and len(unset) == len(set(unset))


def test_conflicting_worker_extension_is_refused(clean_env, tmp_path, capsys):
    parser = flags_parser()
    with pytest.raises(SystemExit):  # given before the flag: argparse error as the flag is parsed
        parser.parse_args(["--worker-extension-cls", "x.Y", "--enable-delta-updates"])
    with pytest.raises(SystemExit):  # given after it: refused once the whole line is parsed
        parser.parse_args(
            [
                "--enable-delta-updates",
                "--delta-updates-root",
                str(tmp_path),
                "--host",
                "127.0.0.1",
                "--worker-extension-cls",
                "x.Y",
            ]
        )
    assert "--worker-extension-cls x.Y" in capsys.readouterr().err


def test_root_is_required_and_must_exist(clean_env, tmp_path, capsys):
    with pytest.raises(SystemExit):
        flags_parser().parse_args(["--enable-delta-updates", "--host", "127.0.0.1"])
    assert "--enable-delta-updates requires --delta-updates-root DIR" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentError, match="not an existing directory"):
        flags_parser().parse_args(["--delta-updates-root", str(tmp_path / "nope")])
    with pytest.raises(argparse.ArgumentError, match="positive"):
        flags_parser().parse_args(["--delta-updates-chunk-bytes", "0"])


@pytest.mark.heavy
def test_vllm_serve_parser_has_the_flags(clean_env, tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    stock = parser.parse_args(["model"])
    assert stock.enable_delta_updates is False and stock.worker_extension_cls == ""
    args = parser.parse_args(
        ["model", "--enable-delta-updates", "--delta-updates-root", str(tmp_path), "--host", "127.0.0.1"]
    )
    assert args.worker_extension_cls == cli_args.WORKER_EXTENSION
