"""The additive digest's two lanes: the one definition that the torch code (`digest`) and the compiled
code (`digest_jit`, which freezes them when it compiles) both read, so neither imports the other."""

from __future__ import annotations


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


# Per lane: the constant its key is offset by, the mixer's three shifts and two multipliers.
# splitmix64's finaliser (lane 0) and Murmur3's fmix64 (lane 1, whose key is XORed with its constant
# first, so the two lanes see different inputs).
LANES = (
    (_i64(0x9E3779B97F4A7C15), (30, 27, 31), (_i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB))),
    (_i64(0xC2B2AE3D27D4EB4F), (33, 33, 33), (_i64(0xFF51AFD7ED558CCD), _i64(0xC4CEB9FE1A85EC53))),
)
