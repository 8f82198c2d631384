"""Executors: how a scheduled step reaches the device and its tokens come back to the host. The builder picks one
for the engine's life: plain, overlapped or speculative. The core's step drives each the same way:

    settle()   results the next schedule depends on (a verify step's; an overlapped step whose rows' next draw
               reads the host's tokens)
    schedule() the plan (speculative: drafts proposed first, the unscheduled ones' dropped after)
    launch()   the plan's forward (and sampling) queued on the device: an `InFlight`
    collect()  results readable now (plain: the step just launched; overlapped: the one before it)
    commit()   bookkeeping once those results were accepted

An `InFlight` is a step launched whose results the host has not read: `resolve()` reads them (the pattern of
`Sampler.sample = launch().resolve()`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from m3sdk.core.hooks import LayerHook
from m3sdk.core.output import Emitted
from m3sdk.core.overlap import OverlapChoice
from m3sdk.prompt_logprobs import PendingPromptLogprobs, widen_for_prompt_logprobs
from m3sdk.request import Request
from m3sdk.runner import PLACEHOLDER, Carry, ModelRunner
from m3sdk.sampler import PendingSample, Sampler
from m3sdk.scheduler.base import Scheduler, StepPlan
from m3sdk.speculative.decoding import Launched, Speculation

if TYPE_CHECKING:
    import torch


class InFlight(Protocol):
    plan: StepPlan

    def resolve(self) -> list[Emitted]:
        """Wait for the step's results (only them) and read them."""


@dataclass
class SampledStep:
    """A forward whose sampling is launched: `rows` sample, in plan order; with `slots`, row i's token stands as a
    PLACEHOLDER at `token_ids[slots[i]]` (an overlapped step's); `prompt`: the prompt logprobs it computes."""

    plan: StepPlan
    rows: list[Request]
    slots: list[int] | None
    sample: PendingSample | None
    prompt: PendingPromptLogprobs | None = None

    def carry(self) -> Carry | None:
        if self.sample is None:
            return None
        return Carry(self.sample.tokens, {id(r): i for i, r in enumerate(self.rows)})

    def resolve(self) -> list[Emitted]:
        if self.prompt is not None:  # before the tokens: the first token's chunk carries them
            self.prompt.resolve()
        if self.sample is None:
            return []
        tokens = self.sample.resolve()
        slots = self.slots if self.slots is not None else [None] * len(self.rows)
        return [(r, [t], at) for r, at, t in zip(self.rows, slots, tokens, strict=True)]


@dataclass
class VerifyStep:
    """A speculative step (verify rows and plain rows) launched on the device."""

    launched: Launched
    spec: Speculation

    @property
    def plan(self) -> StepPlan:
        return self.launched.plan

    def resolve(self) -> list[Emitted]:
        return [(r, tokens, None) for r, tokens in self.spec.finish(self.launched)]


class Executor:
    """The plain one: launch, then read the step at once."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, aux_layers: tuple[int, ...] = ()):
        self.runner, self.scheduler, self.sampler = runner, scheduler, sampler
        # layers whose inputs every forward also returns: a speculating engine's plain steps ask for its drafter's,
        # so they replay the graphs captured with them
        self.aux_layers = aux_layers
        self.in_flight: InFlight | None = None

    @property
    def busy(self) -> bool:
        """A step is on the device whose results the host has not read."""
        return self.in_flight is not None

    def settle(self) -> list[Emitted]:
        return []

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def launch(self, plan: StepPlan, layer_hook: LayerHook | None) -> None:
        self.in_flight = self._sampled(plan, None, layer_hook, placeholders=False)

    def collect(self) -> list[Emitted]:
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
        emitted = step.resolve()
        self.scheduler.update(step.plan)  # before the tokens are accepted: a finishing request's pages get cached
        return emitted

    def commit(self) -> None:
        pass

    def release(self, request: Request) -> None:
        """A request finished: drop what the executor keeps for it."""

    def reset(self) -> None:
        """Counters from zero (after the warm-up); nothing is in flight."""

    def stats(self) -> dict[str, object]:
        return {}

    def _sampled(self, plan: StepPlan, prev: SampledStep | None, layer_hook: LayerHook | None,
                 placeholders: bool) -> SampledStep:
        rows = [s.request for s in plan.scheduled if s.samples]
        logits, prompt = self._forward(plan, prev.carry() if prev is not None else None, layer_hook)
        sample = self.sampler.launch(logits, [r.sampling for r in rows]) if rows else None
        return SampledStep(plan, rows, _placeholders(rows) if placeholders else None, sample, prompt)

    def _forward(self, plan: StepPlan, carry: Carry | None, layer_hook: LayerHook | None
                 ) -> tuple[torch.Tensor | None, PendingPromptLogprobs | None]:
        """The plan's forward: logits of its sampling rows, and the prompt logprobs it computes, launched."""
        if not any(sc.request.needs_prompt_logprobs for sc in plan.scheduled):
            return self.runner.run(plan, carry, layer_hook, self.aux_layers), None
        num_logits, prompt = widen_for_prompt_logprobs(plan, [int(sc.samples) for sc in plan.scheduled])
        logits = self.runner.forward(plan, num_logits, self.aux_layers, carry=carry, layer_hook=layer_hook)[0]
        # each sampling entry's last row
        ends = list(itertools.accumulate(num_logits))
        sample_rows = [end - 1 for sc, end in zip(plan.scheduled, ends, strict=True) if sc.samples]
        return (logits[sample_rows] if sample_rows else None), prompt.launch(logits)


def _placeholders(rows: list[Request]) -> list[int]:
    """Each row's token-to-be as a PLACEHOLDER at the end of its token_ids: where it stands."""
    slots = []
    for request in rows:
        request.token_ids.append(PLACEHOLDER)
        slots.append(request.num_tokens - 1)
    return slots


def _lag_safe(request: Request) -> bool:
    """Its next draw does not read its own last token on the host (penalties count it, a seed counts tokens, so
    does min_tokens until it is reached)."""
    return request.params.seed is None and not request.params.has_penalties and not request.sampling.masks_stops


class OverlappedExecutor(Executor):
    """Step N+1 is scheduled and launched while step N may still run on the device, then N's tokens are read.

    N's sampled tokens stand as PLACEHOLDERs in `token_ids` (so the scheduler gives each such request its decode
    token) and reach N+1's input ids on the device (the runner's Carry). The host then waits for N's tokens only
    (not for N+1), the core accepts them (detokenize, stop checks, finish), and only then `commit` runs
    `Scheduler.update` for N+1, so the pages it commits to the prefix cache hash real tokens. A request that
    finished at N was scheduled in N+1 too: that token is dropped (its pages are freed at once; N+1's late writes
    into them come before any later step's on the same stream). When N+1 samples a row with a structured output,
    its sampling is launched in `commit`, after N's tokens were accepted (its bitmask needs them).

    With a `choice` (core/overlap.py), a step may instead read N's tokens first (`settle`) and then run as a plain
    step (launch, read at once: `collect`), whichever kind measured the shorter period at its batch size; without
    one, every step overlaps."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler,
                 choice: OverlapChoice | None = None, aux_layers: tuple[int, ...] = ()):
        super().__init__(runner, scheduler, sampler, aux_layers)
        self.choice = choice
        self._prev: SampledStep | None = None  # step N, launched before the step now being scheduled
        # step N+1 whose forward is launched and whose sampling waits for N's tokens (structured outputs)
        self._unsampled: tuple[SampledStep, torch.Tensor] | None = None
        self._plain = False  # the step in flight is read at once (`collect`), as the plain executor's

    @property
    def busy(self) -> bool:
        return self.in_flight is not None or self._prev is not None

    def settle(self) -> list[Emitted]:
        self._prev, self.in_flight, self._plain = self.in_flight, None, False
        if self._prev is None:
            return []
        # their next draw reads the host's tokens, or reading first measured faster here: settle them first
        if not all(_lag_safe(r) for r in self._prev.rows) or (
                self.choice is not None and not self.choice.overlap(len(self._prev.rows))):
            prev, self._prev = self._prev, None
            return prev.resolve()
        return []

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        if not plan:
            self.idle()
        return plan

    def idle(self) -> None:
        """The engine may now wait for work, or run other steps: the period running now is no step's cost."""
        if self.choice is not None:
            self.choice.idle()

    def launch(self, plan: StepPlan, layer_hook: LayerHook | None) -> None:
        rows = [sc.request for sc in plan.scheduled if sc.samples]
        if self.choice is not None:
            self.choice.launched(time.perf_counter(), len(rows), self._prev is not None,
                                 all(sc.samples and sc.num_new_tokens == 1 for sc in plan.scheduled))
            # reading first measured faster at this batch: no step is in flight, so this one runs as a plain step
            # (its tokens read right after the launch, then emitted), not as one read after the next is emitted
            self._plain = self._prev is None and not self.choice.overlap(len(rows))
            if self._plain:
                super().launch(plan, layer_hook)
                return
        if self._prev is None or all(r.sampling.grammar is None for r in rows):
            self.in_flight = self._sampled(plan, self._prev, layer_hook, placeholders=True)
            return
        # a row's grammar bitmask needs step N's token accepted on the host: the forward is queued now, its
        # sampling in `commit`, after the core accepted N's tokens (the masks are filled while the forward runs)
        logits, prompt = self._forward(plan, self._prev.carry(), layer_hook)
        self._unsampled = SampledStep(plan, rows, _placeholders(rows), None, prompt), logits

    def collect(self) -> list[Emitted]:
        if self._plain:
            return super().collect()
        prev, self._prev = self._prev, None
        return prev.resolve() if prev is not None else []

    def stats(self) -> dict[str, object]:
        return self.choice.stats() if self.choice is not None else {}

    def commit(self) -> None:
        if self._unsampled is not None:
            (step, logits), self._unsampled = self._unsampled, None
            step.sample = self.sampler.launch(logits, [r.sampling for r in step.rows]) if step.rows else None
            self.in_flight = step
        if self.in_flight is not None:
            self.scheduler.update(self.in_flight.plan)


class SpeculativeExecutor(Executor):
    """Each step finishes the verify step the one before launched (its tokens are accepted, which decides who
    finished), then proposes, schedules and launches the next: the core emits the finished step's deltas and reads
    its inbox while the device runs the new one (spec/decoding.py has the step's stages).

    Where the draft depth is 0 (speculative/depth.py) and a `plain` executor is given, the steps are that
    overlapped executor's: plain decode steps, each launched before the one before is read where that measured
    faster, as a plain engine's. When drafting resumes, the plain step in flight is read first."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, spec: Speculation,
                 plain: OverlappedExecutor | None = None):
        super().__init__(runner, scheduler, sampler)
        self.spec, self.plain = spec, plain
        self._plain_now = False  # this step runs through `plain`

    @property
    def busy(self) -> bool:
        return self.in_flight is not None or (self.plain is not None and self.plain.busy)

    def settle(self) -> list[Emitted]:
        emitted: list[Emitted] = []
        step, self.in_flight = self.in_flight, None
        if step is not None:
            emitted = step.resolve()
            self.scheduler.update(step.plan)
            self.spec.finish_step()
        self._plain_now = self.plain is not None and self.spec.next_depth == 0
        if self.plain is not None and self.plain.busy:
            emitted += self.plain.settle()
            if not self._plain_now:  # drafting resumes: the drafter proposes from the host's tokens
                emitted += self.plain.collect()
        return emitted

    def schedule(self) -> StepPlan:
        self.spec.propose(self.scheduler.live_requests())
        plan = self.scheduler.schedule()
        self.spec.scheduled(plan)
        if not plan:  # the engine may now wait for work: that wait is no step's cost
            self.spec.depth.idle()
            if self.plain is not None:
                self.plain.idle()
        return plan

    def launch(self, plan: StepPlan, layer_hook: LayerHook | None) -> None:
        if self._plain_now:
            self.spec.launched_plain(plan)
            self.plain.launch(plan, layer_hook)
            return
        if self.plain is not None:
            self.plain.idle()
        self.in_flight = VerifyStep(self.spec.launch(plan, self.runner, layer_hook), self.spec)

    def collect(self) -> list[Emitted]:
        return self.plain.collect() if self._plain_now else []

    def commit(self) -> None:
        if self._plain_now:
            self.plain.commit()

    def release(self, request: Request) -> None:
        self.spec.release(request)

    def reset(self) -> None:  # its acceptance too (the warm-up's random prompts draft badly); the costs stay
        self.spec = Speculation(self.spec.drafter, self.spec.cache, self.sampler, self.spec.depth.after_warm_up())

    def stats(self) -> dict[str, object]:
        return {**self.spec.stats(), **(self.plain.stats() if self.plain is not None else {})}
