"""Where one sync's time goes: seconds per phase, per rank, and how they combine across ranks.

Why its own module: the workers time the phases they run (read, decode, scatter, ...) and the
door times the ones only it sees (agreement, pause, resume); both speak this one shape, and the
response, `/delta_updates/status` and the Prometheus histogram all read it. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter

# The phases of one sync, in the order they run. Worker phases first (prepare, then commit), then
# the door's own. A phase that did not run is absent, not zero. No `hash`: each flush's xxh3 is
# checked by the reader as it reads and decodes the flush, on the decode threads, ahead of and
# beside the staging; `decode` is what staging waits for that reader, the hash included.
# `prebuild`: the post-load work built while serving (vLLM's CPU linear repack), swapped in at commit.
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
    """The phases (of `phases`) of the rank that spent longest in them: the ranks run in parallel, so that
    rank is what the step waited for. One rank's phases, not each phase's maximum over ranks: those add
    up to more than any rank took when the ranks are slow in different phases."""
    wanted = tuple(phases)
    best: dict[str, float] = {}
    for times in ranks:
        mine = {p: times[p] for p in wanted if p in times}
        if not best or sum(mine.values()) > sum(best.values()):
            best = mine
    return best
