"""DraftDepth: how many tokens each step drafts per request (0: a plain decode step), chosen step by step from the
live batch size, the measured acceptance and the measured cost of a step.

A step of b decoding requests that each verify k drafts emits b * E(k) tokens, where E(k) = 1 + p_1 + ... + p_k
and p_i is the share of verify rows whose first i drafts were all accepted (`Acceptance`: a running average, old
rows decaying, pulled toward a prior where few rows were seen). It takes cost(b, k) seconds of the engine's wall
clock: the period from one step's launch to the next one's, host work included, which is what a user waits for
(`StepCosts`: the median of the last periods measured for the batch bucket of b and the depth k; measured online
as steps run). The depth is the k in 0 .. k_max that maximizes E(k) / cost(b, k) (`best_depth`).

At each batch bucket k_max, then 0, run a few steps each before their costs are trusted; a depth in between
that has not been measured is priced by linear interpolation between those two, which is optimistic (the draft
network's run costs the same whatever the depth), so it is tried, and measured, exactly when it might win. The
choice thus rests on measurements of this engine on this device, not on a model of it. A depth that lost is
measured again only when it is chosen again, which a change in acceptance can bring about.
"""

from __future__ import annotations

from collections.abc import Sequence

from m3sdk.step_costs import MIN_SAMPLES, StepCosts

# each verify row's weight in the acceptance decays by this per verify row after it (about the last 200 rows count)
ACCEPTANCE_DECAY = 0.995
# the acceptance prior: each draft accepted with this probability given its predecessors were, worth this many rows
PRIOR_ACCEPTANCE = 0.7
PRIOR_ROWS = 8.0
# the depth running stays while its tokens per second are within this share of the best depth's
KEEP_MARGIN = 0.03


def best_depth(expected_tokens: Sequence[float], costs: Sequence[float], keep: int | None = None,
               margin: float = KEEP_MARGIN) -> int:
    """The depth k that emits the most tokens per second: argmax of expected_tokens[k] / costs[k] (ties: the
    shallower; a cost of 0 or less counts as unknown and is skipped). `keep` (the depth now running) stays while
    it is within `margin` of the best: a switch costs a step (the drafter's contexts restart after plain steps)."""
    best, rate = 0, -1.0
    for k, (tokens, cost) in enumerate(zip(expected_tokens, costs, strict=True)):
        if cost > 0 and tokens / cost > rate * (1 + 1e-9):
            best, rate = k, tokens / cost
    if keep is not None and costs[keep] > 0 and expected_tokens[keep] / costs[keep] >= (1 - margin) * rate:
        return keep
    return best


class Acceptance:
    """The running share of verify rows whose first i drafts were all accepted, i = 1 .. k_max."""

    def __init__(self, k_max: int, decay: float = ACCEPTANCE_DECAY, prior: float = PRIOR_ACCEPTANCE,
                 prior_rows: float = PRIOR_ROWS):
        self.decay, self.prior_rows = decay, prior_rows
        self.prior = [prior ** (i + 1) for i in range(k_max)]
        self.drafted = [0.0] * k_max  # decayed rows that verified a draft at position i
        self.accepted = [0.0] * k_max  # decayed rows whose drafts 0 .. i were all accepted

    def add(self, rows: Sequence[tuple[int, int]]) -> None:
        """One step's verify rows: (drafts verified, drafts accepted) each."""
        if not rows:
            return
        scale = self.decay ** len(rows)
        self.drafted = [d * scale for d in self.drafted]
        self.accepted = [a * scale for a in self.accepted]
        for drafts, accepted in rows:
            for i in range(drafts):
                self.drafted[i] += 1.0
                self.accepted[i] += i < accepted

    def expected_tokens(self) -> list[float]:
        """E(k) for k = 0 .. k_max: tokens a request emits per step verifying k drafts."""
        out = [1.0]
        for d, a, p in zip(self.drafted, self.accepted, self.prior, strict=True):
            out.append(out[-1] + (a + self.prior_rows * p) / (d + self.prior_rows))
        return out


class DraftDepth:
    """The depth of each step (`choose`) and what it learns from each step (`launched`, `verified`).

    The engine calls `launched(now, batch, depth, next_depth, clean)` at each step's launch: the period since the
    previous launch is that step's cost, counted when the previous step was clean (decode and verify rows only)
    and drafted for the step after it exactly when it verified drafts itself (its period then holds one draft
    run, as a steady state's does)."""

    def __init__(self, k_max: int, buckets: Sequence[int], adaptive: bool = True):
        self.k_max, self.adaptive = k_max, adaptive
        self.acceptance = Acceptance(k_max)
        self.costs = StepCosts(k_max + 1, buckets)
        self._last: tuple[float, int, int, bool] | None = None  # the previous launch: time, batch, depth, counts
        self.chosen = [0] * (k_max + 1)  # steps launched at each depth (stats)
        self._running: dict[int, int] = {}  # batch bucket -> the depth it chose last (kept within KEEP_MARGIN)

    def choose(self, batch: int) -> int:
        """The depth for a step of `batch` decoding requests."""
        if not self.adaptive or batch < 1:
            return self.k_max
        for k in (self.k_max, 0):  # the ends, measured first
            if self.costs.samples(batch, k) < MIN_SAMPLES:
                return k
        plain, deepest = self.costs.cost(batch, 0), self.costs.cost(batch, self.k_max)
        costs = [self.costs.cost(batch, k) if self.costs.samples(batch, k) >= MIN_SAMPLES
                 else plain + (deepest - plain) * k / self.k_max for k in range(self.k_max + 1)]
        bucket = self.costs.bucket(batch)
        depth = self._running[bucket] = best_depth(self.acceptance.expected_tokens(), costs,
                                                   self._running.get(bucket))
        return depth

    def launched(self, now: float, batch: int, depth: int, next_depth: int, clean: bool) -> None:
        """A step of `batch` decoding rows verifying up to `depth` drafts each was launched at `now`; it drafted
        for a next step of `next_depth`."""
        if self._last is not None:
            t, b, k, counts = self._last
            if counts:
                self.costs.add(b, k, now - t)
        self.chosen[depth] += 1
        self._last = (now, batch, depth, clean and batch > 0 and (depth > 0) == (next_depth > 0))

    def idle(self) -> None:
        """The engine waited for work: the period running now is not a step's cost."""
        self._last = None

    def verified(self, rows: Sequence[tuple[int, int]]) -> None:
        """A step's verify rows: (drafts verified, drafts accepted) each."""
        self.acceptance.add(rows)

    def after_warm_up(self) -> DraftDepth:
        """A chooser that keeps the measured costs (the device's and host's, whatever the prompts were) and
        forgets the acceptance (the warm-up's random prompts draft badly)."""
        fresh = DraftDepth(self.k_max, self.costs.buckets, self.adaptive)
        fresh.costs = self.costs
        return fresh

    def stats(self) -> dict[str, object]:
        return {"spec_adaptive": self.adaptive, "spec_steps_by_depth": list(self.chosen),
                "spec_expected_tokens": [round(e, 3) for e in self.acceptance.expected_tokens()]}
