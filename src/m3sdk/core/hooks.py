"""The extension points the engine core declares; others plug in through these alone (never by setting the
core's attributes or wrapping its parts). Every method here is called in the engine thread.

- `FinishListener`: told when a request finishes, before its pages are freed. One whose I/O still reads or writes
  the request's pages returns a `PageHold`: the pages stay out of use until it completes (the engine thread never
  waits for it).
- `StepObserver`: sees each step's plan before its forward, and may ask to be called after each layer's attention
  in that forward (its cache writes are queued by then).
- `Admission`: may take a request as it arrives, instead of the scheduler (remote prefill). While it holds a
  request it owns it and its pages; it hands the request over to the scheduler (`handovers`) when the core is woken.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from m3sdk.request import Chunk, FinishReason, Request
from m3sdk.sampler import SampledToken
from m3sdk.scheduler.base import StepPlan

Emit = Callable[[list[Chunk]], None]  # one call per step with every delta of it
OnDead = Callable[[BaseException], None]  # the loop raised: it has ended
Wake = Callable[[], None]  # from any thread: the loop reads its inbox (an Admission's outcome is ready)
LayerHook = Callable[[int], None]  # called with a layer's index after its attention, inside the forward

PageHold = Future[Any]


class FinishListener(Protocol):
    def __call__(self, request: Request, reason: FinishReason) -> PageHold | None: ...


class StepObserver(Protocol):
    def on_step(self, plan: StepPlan) -> LayerHook | None:
        """A step is scheduled (warm-up steps included); its forward has not started. Returns the hook to run after
        each layer's attention in that forward, or None (most steps: then the forward runs as it would)."""


@dataclass
class Handover:
    """A request an Admission gives to the scheduler, holding pages for its whole prompt: `first_token` when its
    prompt was computed elsewhere (its pages are valid), else it is prefilled here from `num_computed_tokens`, or
    fails with `error` (PrefillNodeError)."""

    request: Request
    first_token: SampledToken | None = None
    error: Exception | None = None


class Admission(Protocol):
    def admit(self, request: Request) -> bool:
        """Take an arriving request (True: it holds the request's pages now) or leave it to the scheduler."""

    def get(self, request_id: str) -> Request | None:
        """A request it holds."""

    def live_requests(self) -> list[Request]:
        """Every request it holds."""

    def drop(self, request: Request, reason: FinishReason) -> None:
        """A request it holds finished (aborted): stop its work; its pages are freed once nothing writes them (in a
        later `handovers` call)."""

    def handovers(self) -> list[Handover]:
        """Requests whose outside work ended, to run on here (and pages of dropped ones freed meanwhile)."""

    def stats(self) -> dict[str, int | float]:
        """Its counters, merged into the core's stats() (and so into the Prometheus metrics) after every step."""

    def close(self) -> None:
        """The loop ended."""
