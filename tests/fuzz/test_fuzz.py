"""The fuzz harnesses in the light suite: every input that ever failed, the writer's seeds, and a short
fixed-seed property run of mutated seeds (hypothesis, derandomized: the same inputs every run).

Why here as well as in `make fuzz`: the coverage-guided runs take minutes per harness; these take a
few seconds and keep each harness and every past finding exercised on every change.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from fuzz_corpus import HARNESSES as NAMES
from fuzz_corpus import seeds
from fuzz_harnesses import HARNESSES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REGRESSIONS = Path(__file__).parent / "regressions"
SEEDS = seeds()
EXAMPLES = {"manifest": 15, "flush": 10, "params": 15, "gaps": 20, "seed": 10}


@pytest.fixture(scope="module", autouse=True)
def traced():
    """A seed of each run once untraced (imports, compiled kernels), then allocations counted."""
    for name in NAMES:
        HARNESSES[name](SEEDS[name][0])
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _regressions() -> list:
    return [
        pytest.param(f.parent.name, f, id=f"{f.parent.name}/{f.name}")
        for f in sorted(REGRESSIONS.glob("*/*"))
        if f.is_file()
    ]


@pytest.mark.parametrize("harness, path", _regressions())
def test_every_past_finding_passes(harness, path):
    HARNESSES[harness](path.read_bytes())


def test_every_harness_has_seeds_and_they_pass():
    for name in NAMES:
        assert SEEDS[name], name
        for data in SEEDS[name]:
            HARNESSES[name](data)


@st.composite
def mutated(draw, name: str) -> bytes:
    """A seed with a few bytes overwritten, inserted or dropped, and perhaps truncated."""
    data = bytearray(draw(st.sampled_from(SEEDS[name])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        kind = draw(st.sampled_from(["set", "insert", "drop"]))
        byte = draw(st.integers(0, 255))
        if kind == "set" and data:
            data[at] = byte
        elif kind == "insert":
            data.insert(at, byte)
        elif data:
            del data[at]
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@pytest.mark.parametrize("name", NAMES)
def test_mutated_seeds(name):
    @settings(
        max_examples=EXAMPLES[name],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated(name))
    def run(data: bytes) -> None:
        HARNESSES[name](data)

    run()
