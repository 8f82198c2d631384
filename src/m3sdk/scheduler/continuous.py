"""Continuous batching: every step mixes the running requests' decodes and prefill chunks with new requests.

Order is (priority, arrival): running requests are served first in that order, then waiting ones are admitted
while the token budget (`max_num_batched_tokens`), `max_num_seqs` and free pages allow. Long prompts are
prefilled in chunks. When a running request needs a page and none is left, the last request in that order is
preempted: its pages are freed and it waits to be recomputed from its tokens (prompt + what it generated,
often a prefix-cache hit). The first request in order can always grow (the cache holds at least one
`max_model_len` sequence), so the batch never deadlocks and no request is lost; only pages held outside the
scheduler (requests an admission took for remote prefill) can leave nothing to schedule until they come back.
A request added with pages and computed tokens already (handed over that way) is admitted from there.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from m3sdk.cache.manager import CacheManager
from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.request import FinishReason, Request, RequestStatus
from m3sdk.scheduler.base import Scheduled, StepPlan

if TYPE_CHECKING:
    from m3sdk.config import EngineConfig


def _key(request: Request) -> tuple[int, float, int]:
    return request.sort_key


class ContinuousScheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request decodes)")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key; the last one is preempted first
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @classmethod
    def from_config(cls, cache: CacheManager, config: EngineConfig) -> ContinuousScheduler:
        return cls(cache, config.max_num_seqs, config.max_num_batched_tokens)

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
        i = 0
        while i < len(self.running):
            request = self.running[i]
            # Leave one token of budget for each running request after this one: decodes never starve
            # behind a long prefill chunk.
            n = min(request.num_tokens - request.num_computed_tokens, budget - (len(self.running) - i - 1))
            while not self.cache.allocate(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                plan.scheduled.append(self._scheduled(request, n))
                budget -= n
                i += 1
        if plan.preempted:
            return plan  # pages are short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            prefix = self.cache.match_prefix(request)  # none for a request holding pages already
            cached = max(len(prefix) * PAGE_SIZE, request.num_computed_tokens)
            n = min(request.num_tokens - cached, budget)
            if not self.cache.allocate(request, n, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[0]
            request.num_computed_tokens = cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_key)
            plan.scheduled.append(self._scheduled(request, n))
            budget -= n
        return plan

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
