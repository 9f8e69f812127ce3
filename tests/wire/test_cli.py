"""`vllm-delta` on real HF-style checkpoint directories (sharded with an index, and single-file)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from wire_helpers import seed_flush_bytes

from vllm_delta.cli import main
from vllm_delta.wire import ENCODINGS

INT = {2: torch.int16, 4: torch.int32}


def load_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(INT[a[k].element_size()]), b[k].view(INT[b[k].element_size()])), k


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_diff_then_apply_reproduces_new(tmp_path, checkpoints, encoding, capsys):
    old, new, _ = checkpoints
    assert (
        main(
            [
                "diff",
                str(old),
                str(new),
                str(tmp_path / "delta"),
                "--encoding",
                encoding,
                "--version",
                "5",
                "--base-version",
                "4",
                "--flush-bytes",
                "2000",
            ]
        )
        == 0
    )
    assert main(["apply", str(old), str(tmp_path / "delta"), str(tmp_path / "out")]) == 0
    assert_bit_identical(load_dir(tmp_path / "out"), load_dir(new))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in new.iterdir())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    shard = next((tmp_path / "out").glob("*.safetensors"))
    with safe_open(shard, framework="pt") as h:
        assert h.metadata() == {"format": "pt"}


def test_inspect_json_and_table(tmp_path, checkpoints, capsys):
    old, new, tensors = checkpoints
    main(["diff", str(old), str(new), str(tmp_path / "d"), "--flush-bytes", "1000"])
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "d"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    total = sum(t.numel() for t in tensors.values())
    assert s["version"] == 1 and s["base_version"] == 0 and s["encoding"] == "ulp_zstd"
    assert s["elements"] == total and s["elements_scope"] == "model"
    assert 0.03 < s["density"] < 0.07 and s["needs_base"] and not s["idempotent"]
    assert len(s["files"]) > 1 and sum(f["changed"] for f in s["files"]) == s["changed"]
    assert s["bytes"] == sum(f["bytes"] for f in s["files"])
    assert s["bytes_per_changed"] == pytest.approx(s["bytes"] / s["changed"])
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "B / changed" in out and "rank0000_flush000000.safetensors" in out


def test_verify(tmp_path, checkpoints, capsys):
    old, new, _ = checkpoints
    main(["diff", str(old), str(new), str(tmp_path / "d"), "--encoding", "deltas_zstd"])
    assert main(["verify", str(tmp_path / "d")]) == 0
    assert main(["verify", str(tmp_path / "d"), "--base", str(old)]) == 0
    assert main(["verify", str(tmp_path / "d"), "--base", str(new)]) == 0  # overwrite: idempotent
    # a base-relative delta on the wrong base decodes, but fails the post-apply hashes
    main(["diff", str(old), str(new), str(tmp_path / "u"), "--encoding", "ulp_zstd"])
    assert main(["verify", str(tmp_path / "u"), "--base", str(new)]) == 1
    assert "post_hash" in capsys.readouterr().err
    f = next((tmp_path / "d").glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-1])
    assert main(["verify", str(tmp_path / "d")]) == 1
    assert "IntegrityError" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flip", "no_manifest", "wrong_base"])
def test_failed_apply_leaves_no_out(tmp_path, checkpoints, damage, capsys):
    old, new, _ = checkpoints
    main(["diff", str(old), str(new), str(tmp_path / "d")])
    base = old
    if damage == "flip":
        f = next((tmp_path / "d").glob("*.safetensors"))
        data = bytearray(f.read_bytes())
        data[-3] ^= 1
        f.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (tmp_path / "d" / "manifest.json").unlink()
    else:
        base = new
    assert main(["apply", str(base), str(tmp_path / "d"), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_apply_seed_delta(tmp_path, checkpoints):
    old, new, tensors = checkpoints
    base = load_dir(old)
    d = tmp_path / "weight_v000001"
    d.mkdir()
    changes = [(k, base[k], tensors[k]) for k in tensors]
    (d / "rank0000_flush000000.safetensors").write_bytes(seed_flush_bytes(changes, encoding="deltas_zstd"))
    assert main(["apply", str(old), str(d), str(tmp_path / "refused")]) == 1  # only when allowed
    assert not (tmp_path / "refused").exists()
    assert main(["apply", str(old), str(d), str(tmp_path / "out"), "--allow-seed-format"]) == 0
    assert_bit_identical(load_dir(tmp_path / "out"), load_dir(new))


def test_diff_refuses_mismatched_checkpoints(tmp_path, checkpoints, capsys):
    old, new, _ = checkpoints
    other = tmp_path / "other"
    shutil.copytree(new, other)
    for f in other.glob("*.safetensors*"):
        f.unlink()
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(other / "model.safetensors"))
    assert main(["diff", str(old), str(other), str(tmp_path / "d")]) == 1
    assert not (tmp_path / "d").exists()


def test_encodings_json_via_console_script():
    exe = shutil.which("vllm-delta", path=str(__import__("pathlib").Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "vllm_delta.cli"]
    rows = json.loads(
        subprocess.run(cmd + ["encodings", "--json"], check=True, capture_output=True, text=True).stdout
    )
    by = {r["name"]: r for r in rows}
    assert {"indices", "deltas", "deltas_zstd", "planes_zstd", "ulp_zstd"} <= set(by)
    assert by["ulp_zstd"]["needs_base"] and not by["ulp_zstd"]["idempotent"]
    assert all(by[n]["idempotent"] and not by[n]["needs_base"] for n in ("indices", "deltas", "deltas_zstd"))


@pytest.mark.parametrize("family", ["llama", "glm4_moe"])
def test_cli_round_trip_on_tiny_model_checkpoints(tmp_path, tiny_model_factory, family, capsys):
    """The whole CLI on the suite's tiny HF models (GLM4-MoE has an fp32 `e_score_correction_bias`)."""
    from harness.perturb import perturb_checkpoint

    base = tiny_model_factory(family)
    new = perturb_checkpoint(base, tmp_path / "new", density=0.02, seed=7)
    delta, out = tmp_path / "delta", tmp_path / "out"
    assert main(["diff", str(base), str(new), str(delta), "--encoding", "ulp_zstd", "--version", "1"]) == 0
    assert main(["verify", str(delta), "--base", str(base)]) == 0
    assert main(["apply", str(base), str(delta), str(out)]) == 0
    assert_bit_identical(load_dir(out), load_dir(new))
    assert (out / "config.json").read_text() == (base / "config.json").read_text()
    capsys.readouterr()
    assert main(["inspect", str(delta), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 1 and 0 < report["changed"] < report["elements"], report
    assert report["bytes_per_changed"] == pytest.approx(report["bytes"] / report["changed"])
