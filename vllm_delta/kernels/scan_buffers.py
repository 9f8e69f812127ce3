"""The fused CPU scan's output arrays, handed out again from one scan of a bucket to the next once nothing
but this pool holds them. Why: fresh arrays page-fault on every page written, a third of a 1 GB scan
(docs/results/sender.md). A set is reused only when the reference counts of all its arrays (and no weak
reference) show this pool alone holds it: every numpy view and `torch.from_numpy` tensor of one keeps it
alive, so a capture still read always shows. At most two sets per window: the last scan's, and the one
before while something still holds it (its size kept at most twice its changes).
"""

from __future__ import annotations

import sys
import weakref

import numpy as np

Set = list[np.ndarray]  # offsets, HF positions, old bits, new bits, runs: `scan_jit.outputs`


def _refs(arrays: Set) -> list[int]:
    return [sys.getrefcount(a) for a in arrays]


_ALONE = _refs([np.empty(0)])[0]  # an array that only a list holds, as `_refs` counts it


def alone(arrays: Set) -> bool:
    """Nothing but the list `arrays` holds any of them (strongly or weakly)."""
    return max(_refs(arrays)) <= _ALONE and not any(weakref.getweakrefcount(a) for a in arrays)


class ScanBuffers:
    """Output sets per window (lo, hi, dtype, want_run), the most recently written last."""

    def __init__(self) -> None:
        self._sets: dict[tuple, list[Set]] = {}
        self._taken: dict[tuple, Set] = {}  # the last `take`'s, by window
        self.allocated = 0  # sets made fresh (the rest were reused): what tests count

    def take(self, windows: list[tuple[int, int]], like: np.ndarray, want_run: bool) -> list[Set]:
        """A set per window of this scan: a pooled one nothing else holds, else a fresh one."""
        from vllm_delta.kernels.scan_jit import capacity, outputs

        self._taken = {}
        for lo, hi in windows:
            key = (lo, hi, like.dtype, want_run)
            sets = self._sets.setdefault(key, [])
            i = next((i for i, s in enumerate(sets) if alone(s)), None)
            if i is None:
                free = list(outputs(capacity(lo, hi), like, want_run))
                self.allocated += 1
            else:
                free = sets.pop(i)  # by index: `==` on lists of arrays compares their elements
            sets.append(free)
            self._taken[key] = free
        return list(self._taken.values())

    def settle(self, written: list[tuple[int, Set]]) -> None:
        """After a scan: `written` is (changes, arrays the kernel returned) per set of the last `take`.
        A grown set replaces the one taken; a set over twice its changes goes; windows not taken
        this scan go; of the older sets, the most recent one still held elsewhere stays."""
        from vllm_delta.kernels.scan_jit import capacity

        kept = {}
        for (key, taken), (k, out) in zip(self._taken.items(), written):
            older = [s for s in self._sets[key][:-1] if not alone(s)][-1:]
            grown = out[0] is not taken[0]
            last = list(out) if grown else taken
            small = last[0].size <= max(capacity(key[0], key[1]), 2 * k)
            kept[key] = older + ([last] if small else [])
        self._sets, self._taken = kept, {}
