"""A tiny seeded RNG whose whole state is one integer (SplitMix64).

Policies snapshot their RNG with their learned state; Mersenne Twister's
625-word state would swamp `nightjarctl state`, SplitMix64's is one number.
"""

from __future__ import annotations

import hashlib

_MASK = (1 << 64) - 1


class SplitMix64:
    __slots__ = ("state",)

    def __init__(self, seed: int | str = 0) -> None:
        if isinstance(seed, str):
            seed = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little")
        self.state = seed & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        """Uniform float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

    def randint(self, low: int, high: int) -> int:
        """Uniform integer in [low, high] (multiply-shift; bias < 2^-58 for small ranges)."""
        return low + ((self.next_u64() * (high - low + 1)) >> 64)
