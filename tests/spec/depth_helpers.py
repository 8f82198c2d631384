"""A draft-depth chooser for tests that must hold whatever depth each step takes."""

from __future__ import annotations

import random
from collections.abc import Callable


def sticky_random_depth(rng: random.Random) -> Callable[[object, int], int]:
    """A `DraftDepth.choose` that keeps its depth for a few steps, then draws another from 0 .. k."""
    depth: list[int | None] = [None]

    def choose(self, batch: int) -> int:
        if depth[0] is None or rng.random() < 0.35:
            depth[0] = rng.randrange(self.k_max + 1)
        return depth[0]

    return choose
