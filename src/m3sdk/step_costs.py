"""StepCosts: the measured wall-clock period of engine steps per batch bucket and per option of the step (a draft
depth, overlapped or not), for the choices the engine makes step by step from measurements of itself on its
device (speculative/depth.py, core/executor.py) rather than from a model of the device.

A step's period is the time from its launch to the next step's launch, host work included: what a user waits
for per token in steady decoding. Each cell keeps its last periods and reports their median, so a Triton compile
or a step stalled by another thread is one outlier among them.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence

# periods kept per (batch bucket, option)
COST_WINDOW = 16
# periods measured before an option's cost at a batch bucket is trusted
MIN_SAMPLES = 4


class StepCosts:
    """Measured step periods per (batch bucket, option), options 0 .. num_options - 1."""

    def __init__(self, num_options: int, buckets: Sequence[int]):
        self.buckets = list(buckets)
        self.periods = {(b, o): deque(maxlen=COST_WINDOW) for b in self.buckets for o in range(num_options)}

    def bucket(self, batch: int) -> int:
        """The smallest bucket that holds `batch` (the largest for a larger batch)."""
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def add(self, batch: int, option: int, seconds: float) -> None:
        self.periods[(self.bucket(batch), option)].append(seconds)

    def forget(self, batch: int, option: int) -> None:
        """Drop the option's periods at the batch's bucket: it is measured afresh."""
        self.periods[(self.bucket(batch), option)].clear()

    def samples(self, batch: int, option: int) -> int:
        return len(self.periods[(self.bucket(batch), option)])

    def cost(self, batch: int, option: int) -> float:
        """The median measured period (0.0: none measured)."""
        p = self.periods[(self.bucket(batch), option)]
        return statistics.median(p) if p else 0.0
