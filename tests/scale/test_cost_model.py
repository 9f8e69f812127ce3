"""The receiver's cost model in its CI form (issue 16, "What to build" 1: per-unit costs and the projection).

`benchmarks/cost_model.py` runs the real prepare and commit on vLLM's own Glm4Moe class at tiny widths,
on a grid that changes the expert count (checkpoint tensors) and the layer count (destinations)
apart. Asserted here: counts, never a time. The torch ops of a sync are the same whatever the
number of expert tensors behind the fused params and grow with the destinations; the projection
is the sum of its stated terms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cost_model import cost_model  # noqa: E402

# Not a process, but vLLM's import and four model builds: ~15 s on 2 busy cores.
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def result():
    return cost_model([4, 5], [8, 16], (0.005, 0.02), repeats=1, wide_numel=1 << 18)


def _row(result, layers: int, experts: int, density: float) -> dict:
    return next(
        r for r in result["rows"] if (r["layers"], r["experts"], r["density"]) == (layers, experts, density)
    )


@pytest.mark.parametrize("layers", [4, 5])
def test_ops_do_not_grow_with_the_expert_tensors_behind_a_destination(result, layers):
    few, many = _row(result, layers, 8, 0.02), _row(result, layers, 16, 0.02)
    assert many["tensors"] > few["tensors"] and many["destinations"] == few["destinations"]
    assert many["ops"] == few["ops"] and many["device_ops"] == few["device_ops"]


def test_ops_grow_with_the_destinations(result):
    small, large = _row(result, 4, 8, 0.02), _row(result, 5, 8, 0.02)
    assert large["destinations"] > small["destinations"] and large["device_ops"] > small["device_ops"]


def test_the_fit_and_the_projection_are_what_they_say(result):
    for part in ("decode", "stage", "commit", "prepare", "decode_wide"):
        assert all(v >= 0 for c, v in result["fit"][part].items() if c != "max_rel_residual")
    p = result["projection"]
    assert p["node_s"] == pytest.approx(p["decode_s"] + p["host_stage_s"] + p["h2d_s"] + p["device_s"])
    assert p["T_r"] == 44189 and p["C_r"] == pytest.approx(p["params"] * 0.02 / 8)
    fit = result["fit"]["decode_wide"]
    assert p["decode_s"] == pytest.approx(
        (fit["tensors"] * p["T_r"] + fit["changes"] * p["C_r"]) / p["assumed"]["host_threads"]
    )
