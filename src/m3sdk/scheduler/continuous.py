"""Continuous batching: every step mixes the running requests' decodes and prefill chunks with new requests.

Order is (priority, arrival): running requests are served first in that order, then waiting ones are admitted
while the token budget (`max_num_batched_tokens`), `max_num_seqs` and free pages allow. Long prompts are
prefilled in chunks. When a running request needs a page and none is left, the last request in that order is
preempted: its pages are freed and it waits to be recomputed from its tokens (prompt + what it generated,
often a prefix-cache hit). The first request in order can always grow (the cache holds at least one
`max_model_len` sequence), so the batch never deadlocks and no request is lost; only pages held outside the
scheduler (requests an admission took for remote prefill) can leave nothing to schedule until they come back.
A request added with pages and computed tokens already (handed over that way) is admitted from there.

Images: a chunk that reaches an image whose encoder output is not cached runs the encoder on the image's patches
in the same step, and those patches count against the step's budget like tokens. A chunk stops before an image
that would overrun the budget; the image goes in a later step. An image that fits no step (more patches than the
budget left once the running requests' decodes are served) is encoded in the first step whose chunks start no
other encoder work, the only time a step runs over the budget.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from m3sdk.cache.manager import CacheManager
from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.request import FinishReason, Request, RequestStatus
from m3sdk.scheduler.base import EncoderWork, Scheduled, StepPlan

if TYPE_CHECKING:
    from m3sdk.config import EngineConfig


def _key(request: Request) -> tuple[int, float, int]:
    return request.sort_key


class ContinuousScheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 encoder: EncoderWork | None = None):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request decodes)")
        self.cache = cache
        self.encoder = encoder  # what an image's encoding costs a step; None: the engine takes no images
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key; the last one is preempted first
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @classmethod
    def from_config(cls, cache: CacheManager, config: EngineConfig, encoder: EncoderWork | None = None
                    ) -> ContinuousScheduler:
        return cls(cache, config.max_num_seqs, config.max_num_batched_tokens, encoder)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def live_requests(self) -> list[Request]:
        return list(self._requests.values())

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        self._requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_key)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        encoding: set[bytes] = set()  # digests of the images this step encodes
        i = 0
        while i < len(self.running):
            request = self.running[i]
            # Leave one token of budget for each running request after this one: decodes never starve
            # behind a long prefill chunk.
            share = budget - (len(self.running) - i - 1)
            n, used = self._fit(request, request.num_computed_tokens,
                                min(request.num_tokens - request.num_computed_tokens, share), share, encoding)
            if n == 0:  # its next image waits for a step with room for its encoder
                i += 1
                continue
            while not self.cache.allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                plan.scheduled.append(self._scheduled(request, n))
                budget -= used
                i += 1
        if plan.preempted:
            return plan  # pages are short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            prefix = self.cache.match_prefix(request)  # none for a request holding pages already
            cached = max(len(prefix) * PAGE_SIZE, request.num_computed_tokens)
            n, used = self._fit(request, cached, min(request.num_tokens - cached, budget), budget, encoding)
            if n == 0 or not self.cache.allocate(request, n, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[0]
            request.num_computed_tokens = cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_key)
            plan.scheduled.append(self._scheduled(request, n))
            budget -= used
        return plan

    def _fit(self, request: Request, start: int, n: int, budget: int, encoding: set[bytes]) -> tuple[int, int]:
        """(tokens, budget used) of the request's chunk from `start`, at most `n` tokens, when the encoder work it
        triggers counts too: it stops before an image that would overrun `budget`, unless the chunk starts on that
        image and no other encoding is in the step (an image too large for any step goes then, alone). `encoding`
        gains the digests the chunk encodes (each image is encoded once a step, whoever shows it)."""
        if not request.images or self.encoder is None:
            return n, n
        cost = 0
        new: list[bytes] = []
        for image in request.images:
            if image.offset + image.num_tokens <= start:
                continue
            first = max(image.offset, start)  # the chunk's first token of this image
            if first >= start + n:
                break
            work = 0 if image.digest in encoding else self.encoder.encoder_tokens(image)
            if not work:
                continue
            if first - start + 1 + cost + work > budget and not (first == start and not encoding):
                n = first - start
                break
            cost += work
            new.append(image.digest)
        if cost >= budget:  # an image no step has room for, alone: the step's whole budget and more
            encoding.update(new)
            return n, budget
        n = min(n, budget - cost)
        if n > 0:
            encoding.update(new)
        return n, n + cost

    def update(self, plan: StepPlan) -> None:
        for request, n, _ in plan.scheduled:
            if request.is_finished:  # finished while an overlapped step ran (its pages are freed already)
                continue
            request.num_computed_tokens += n
            self.cache.commit(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        if self._requests.pop(request.request_id, None) is None:
            return
        queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        self.cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()

    @staticmethod
    def _scheduled(request: Request, n: int) -> Scheduled:
        return Scheduled(request, n, request.num_computed_tokens + n == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_key)
