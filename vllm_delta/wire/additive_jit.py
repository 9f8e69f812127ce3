"""`wire.additive`'s two digest lanes as numba functions, for the compiled scan and apply kernels.

Why one module: the sender's scan and the receiver's apply must mix keys exactly as
`additive._mix_` does (their tests compare both with it); one definition keeps them from drifting.
Imported only by those kernels' modules (numba costs ~0.3 s to import).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_M1_0, _M2_0 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 (lane 0)
_K_1 = np.uint64(0xC2B2AE3D27D4EB4F)  # lane 1's key is XORed with this first (wire.additive._LANES)
_M1_1, _M2_1 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # Murmur3 fmix64 (lane 1)


@njit(nogil=True, cache=True)
def lane0(x):  # splitmix64's finaliser; additive._mix_ with _LANES[0]
    x ^= x >> np.uint64(30)
    x *= _M1_0
    x ^= x >> np.uint64(27)
    x *= _M2_0
    return x ^ (x >> np.uint64(31))


@njit(nogil=True, cache=True)
def lane1(x):  # Murmur3's fmix64 of the key XOR its first constant; additive._mix_ with _LANES[1]
    x ^= _K_1
    x ^= x >> np.uint64(33)
    x *= _M1_1
    x ^= x >> np.uint64(33)
    x *= _M2_1
    return x ^ (x >> np.uint64(33))
