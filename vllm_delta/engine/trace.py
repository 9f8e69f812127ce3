"""Where one sync's time goes: seconds per phase, per rank, and how they combine across ranks; the
workers' phases and the door's in one shape, which the answer, the status and the metrics read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter

# The phases of one sync, in order; one that did not run is absent. `decode` is what staging waits for
# the reader, each flush's xxh3 check included; `prebuild` the post-load work built while serving.
WORKER_PREPARE = ("receive", "decode", "locate", "digest", "stage", "prebuild")
WORKER_COMMIT = ("scatter", "read_back", "post_load")
# `prepare_wait` and `commit_wait`: the door's wait on the workers beyond the critical rank's worker
# phases (polling, RPC, a rank's untimed work), so that the phases add up to the wall time.
DOOR = ("agree", "prepare_wait", "pause", "commit_wait", "resume")
PHASES = (*WORKER_PREPARE, *WORKER_COMMIT, *DOOR)


@dataclass
class PhaseTimes:
    """Seconds spent in each phase on one rank (or by the door); adds up repeated entries."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown sync phase {phase!r}; known: {PHASES}")
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        started = perf_counter()
        try:
            yield
        finally:
            self.add(phase, perf_counter() - started)

    def as_dict(self, phases: Iterable[str] = PHASES) -> dict[str, float]:
        return {p: round(self.seconds[p], 6) for p in phases if p in self.seconds}


def critical(ranks: Iterable[Mapping[str, float]], phases: Iterable[str]) -> dict[str, float]:
    """The phases (of `phases`) of the rank that spent longest in them, which the step waited for: one
    rank's, as per-phase maxima would add up to more than any rank took."""
    wanted = tuple(phases)
    best: dict[str, float] = {}
    for times in ranks:
        mine = {p: times[p] for p in wanted if p in times}
        if not best or sum(mine.values()) > sum(best.values()):
            best = mine
    return best
