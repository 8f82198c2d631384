"""OverlapChoice: whether each plain decode step of an overlapped engine overlaps (step N + 1 scheduled and
launched before N's tokens are read) or reads first (N's tokens read, then N + 1 scheduled, launched and read at
once, as the synchronous loop's step), chosen per step from
the periods both kinds measured at the step's batch bucket (m3sdk/step_costs.py).

Overlap hides the device's step behind the host's work; it pays when the device step is the longer of the two.
Where the host's work per step is the longer (a small model such as m3-tiny, whose graph step takes ~0.2 ms on an
H200), it hides little and costs more: the engine thread never waits for the device, so the event loop's work on
the emitted tokens, which a read-first step runs while the engine thread waits for the device with the GIL
released, now contends with the engine's own host work for the GIL (a hand-off per torch call), and the step
carries the previous step's tokens on the device (two more launches and their index lists). Reading first then
gives the shorter period. Which one wins depends on the model, the batch and the host, so the engine measures.
"""

from __future__ import annotations

from collections.abc import Sequence

from m3sdk.step_costs import MIN_SAMPLES, StepCosts

READ_FIRST, OVERLAP = 0, 1
# clean decode steps at a batch bucket after which the kind not chosen there is measured again: a median taken
# while other work ran (the first wave's prefills, a compile) would otherwise decide for good
REMEASURE_EVERY = 1024
# overlap is kept only where its median period is at most this fraction of reading first's. A read-first step is
# the synchronous loop's step, so near a tie reading first is the choice that is never slower than sync; where
# overlap pays it pays by far more (the M3 slice on an H200: 26-41 % shorter periods, docs/perf.md), while on a
# host-bound model the two medians differ by ~10 % either way from one window to the next
OVERLAP_MARGIN = 0.95


class OverlapChoice:
    """Both kinds are run at each batch bucket, in alternating pairs of steps (overlap first) until each has
    MIN_SAMPLES periods, so that both are measured under the same load; then overlap where its median period
    beats reading first's by OVERLAP_MARGIN, and the kind not chosen again every REMEASURE_EVERY clean steps
    there. A step's period (to the next launch) counts for its kind when the step and the one after it were both
    of that kind and decoded only (no prefill chunk)."""

    def __init__(self, buckets: Sequence[int]):
        self.costs = StepCosts(2, buckets)
        self._last: tuple[float, int, int, bool] | None = None  # the previous launch: time, batch, kind, counts
        self._clean_steps = dict.fromkeys(self.costs.buckets, 0)  # per bucket, since its last re-measurement
        self.steps = [0, 0]  # steps launched read-first / overlapped (stats)

    def overlap(self, batch: int) -> bool:
        """Whether a step of `batch` decoding rows overlaps."""
        n_overlap, n_read = self.costs.samples(batch, OVERLAP), self.costs.samples(batch, READ_FIRST)
        if min(n_overlap, n_read) < MIN_SAMPLES:
            # the kind with fewer periods runs until it has one more (a period needs two steps of its kind)
            return n_overlap <= n_read if n_read < MIN_SAMPLES else True
        return self.costs.cost(batch, OVERLAP) <= OVERLAP_MARGIN * self.costs.cost(batch, READ_FIRST)

    def launched(self, now: float, batch: int, overlapped: bool, clean: bool) -> None:
        kind = int(overlapped)
        if self._last is not None:
            t, b, k, counts = self._last
            if counts and k == kind:
                self.costs.add(b, k, now - t)
        self.steps[kind] += 1
        self._last = (now, batch, kind, clean and batch > 0)
        if clean and batch > 0:
            bucket = self.costs.bucket(batch)
            self._clean_steps[bucket] += 1
            if self._clean_steps[bucket] >= REMEASURE_EVERY:
                self._clean_steps[bucket] = 0
                self.costs.forget(batch, READ_FIRST if self.overlap(batch) else OVERLAP)

    def idle(self) -> None:
        """The engine may wait for work: the period running now is no step's cost."""
        self._last = None

    def stats(self) -> dict[str, object]:
        return {"overlap_steps": self.steps[OVERLAP], "read_first_steps": self.steps[READ_FIRST]}
