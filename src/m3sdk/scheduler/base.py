"""The Scheduler seam: which requests run this step, and how many tokens each.

A step is a list of (request, num_new_tokens): prefill chunks and decodes mixed. A request's new tokens are
`token_ids[num_computed_tokens : num_computed_tokens + n]`; a step that reaches the request's last known token
ends in logits, so the request samples. A speculating request is scheduled for 1 + k tokens (its drafts ride
in `token_ids`, Contract 5). A request may be added already holding pages and computed tokens (one the engine's
admission handed over after computing its prompt elsewhere, Contract 6): it runs on from `num_computed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from m3sdk.request import FinishReason, Request

if TYPE_CHECKING:
    from m3sdk.images import PromptImage


class Scheduled(NamedTuple):
    request: Request
    num_new_tokens: int
    # The step computes the request's last known token, so its logits are sampled.
    samples: bool


@dataclass
class StepPlan:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class EncoderWork(Protocol):
    """What embedding an image costs a step: the vision encoder's tokens (the image's patches) when its output is
    not cached, else 0 (m3sdk.images.ImagePrompts). A step's prefill tokens and the encoder tokens its chunks
    trigger share `max_num_batched_tokens`."""

    def encoder_tokens(self, image: PromptImage) -> int: ...


class Scheduler(Protocol):
    """Owns request state. Called from the engine thread only. EngineConfig.scheduler names a registered one
    or gives a factory `(cache_manager, config, encoder) -> Scheduler`, `encoder` an EncoderWork or None (an
    engine that takes no images)."""

    num_preemptions: int

    def add(self, request: Request) -> None: ...

    def schedule(self) -> StepPlan: ...

    def update(self, plan: StepPlan) -> None:
        """The plan's forward ran: advance each request's computed tokens and offer its new full pages to the
        prefix cache. (The core appends sampled tokens afterwards.)"""

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request for good and free its pages."""

    def get(self, request_id: str) -> Request | None: ...

    def live_requests(self) -> list[Request]:
        """Every request added and not finished, waiting or running."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...
