"""The decode engine's side of remote prefill: an Admission (m3sdk/core/hooks.py) the core calls in its engine
thread.

`admit` takes an arriving request whose prompt (past what the prefix cache holds) is long enough, while a node is
healthy: it allocates the request's pages for the whole prompt and starts the job on the disagg loop. When the job
ends the core is woken, and `handovers` gives the request to the scheduler: with the node's first token (the pages
are valid from then on), to prefill here into the same pages (fallback "local"), or failed with PrefillNodeError
(fallback "error"). A request dropped mid-transfer (aborted) has its job cancelled; its pages are freed in a later
`handovers`, once the transfer can no longer write them. Nothing here waits for the loop.

Image prompts travel with their image files (the node decodes and encodes them; this engine's encoder never runs
for them) to a node that takes images (Handshake's max_image_bytes). An engine without a vision encoder (built so
with prefill_fallback "error") sends every prompt that computes image tokens to a node, however short, queueing it
here for a job slot and its pages; where no node takes it, it fails with PrefillNodeError.

A long prompt that is prefilled here after all (a fallback: no healthy node, every job slot taken, the pages short,
or the job failed) gets a log line with the reason. `stats()` counts remote prefills, fallbacks, failures, the
bytes received and the time the remote prefills took.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from m3sdk.cache.manager import CacheManager
from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.config import EngineConfig
from m3sdk.core.hooks import Handover
from m3sdk.disagg import wire
from m3sdk.disagg.client import PrefillClient, RemotePrefillResult
from m3sdk.disagg.compat import CompatInfo, model_fingerprint
from m3sdk.disagg.messages import WireImage
from m3sdk.errors import PrefillNodeError
from m3sdk.observability import get_logger
from m3sdk.request import FinishReason, Request, RequestStatus
from m3sdk.sampler import SampledToken

if TYPE_CHECKING:
    from m3sdk.core.engine_core import EngineCore

log = get_logger("m3sdk.disagg.remote")


class RemotePrefill:
    def __init__(self, client: PrefillClient, cache: CacheManager, min_tokens: int, fallback: str, timeout_s: float,
                 max_jobs: int, wake: Callable[[], None], encodes_images: bool = True):
        self.client, self.cache = client, cache
        # whether this engine can compute image tokens itself (else only a node may prefill past an image's start)
        self.encodes_images = encodes_images
        self.min_tokens, self.fallback, self.timeout_s, self.max_jobs = min_tokens, fallback, timeout_s, max_jobs
        self._wake = wake
        self._jobs: dict[str, tuple[Request, Future[RemotePrefillResult]]] = {}
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()  # jobs that ended (any thread puts)
        self._cancelled: queue.SimpleQueue[Request] = queue.SimpleQueue()  # dropped, no longer written
        self._queued: deque[Request] = deque()  # only a node may prefill them: waiting for a job slot and pages
        self.num_remote = self.num_fallbacks = self.num_failures = 0
        self.bytes_received = 0
        self.remote_seconds = 0.0  # summed over remote prefills, call to first token back
        self.nodes_used: dict[str, int] = {}  # node -> remote prefills it served

    @classmethod
    def from_config(cls, config: EngineConfig, cache: CacheManager, vocab_size: int, wake: Callable[[], None],
                    encodes_images: bool = True) -> RemotePrefill:
        compat = CompatInfo.from_spec(cache.kv.spec, model_fingerprint(config.model_path()))
        root = config.prefill_tls_root_cert
        client = PrefillClient(list(config.prefill_nodes), compat, wire.page_rows(cache.kv), vocab_size,
                               token=config.prefill_token, tls_root_certificates=Path(root).read_bytes() if root
                               else None)
        try:
            client.start()
        except BaseException:  # e.g. an incompatible node: close the transport and channels opened so far
            client.close()
            raise
        return cls(client, cache, config.remote_prefill_min_tokens, config.prefill_fallback, config.prefill_timeout,
                   config.max_num_seqs, wake, encodes_images)

    @classmethod
    def for_core(cls, config: EngineConfig, core: EngineCore) -> RemotePrefill:
        """The admission of `core` (passed to its `start`, beside which it lives: in the engine thread's process,
        or in the engine process), handshaken with config.prefill_nodes (this blocks, up to a connect timeout
        each)."""
        return cls.from_config(config, core.cache, core.vocab_size, core.wake,
                               encodes_images=core.images is None or core.images.encodes)

    # -- Admission -------------------------------------------------------------------------------------------

    def admit(self, request: Request) -> bool:
        prefix = self.cache.match_prefix(request)
        cached = len(prefix) * PAGE_SIZE
        if not self._prefills_here(request, cached):
            # only a node may prefill it, however short: it waits here for a job slot and the pages
            self._queued.append(request)
            self._start_queued()
            return True
        if request.num_prompt_tokens - cached < self.min_tokens:
            return False
        if len(self._jobs) >= self.max_jobs:
            return self._local(request, f"{self.max_jobs} remote prefills in flight already")
        # with every node down, prefill locally at once rather than fail each request on the way
        if not (self.client.has_healthy_node or self.fallback == "error"):
            states = "; ".join(f"{node}: {state}" for node, state in self.client.node_states().items())
            return self._local(request, f"no healthy prefill node ({states})")
        image_bytes = sum(len(i.data) for i in request.images)
        if image_bytes and self.fallback == "local" and not self.client.takes_images(image_bytes):
            return self._local(request, f"no healthy prefill node takes images ({image_bytes} bytes)")
        # the scheduler queues it when the pages are short
        return self._launch(request, prefix) or self._local(request, "too few free KV pages for the whole prompt")

    def _launch(self, request: Request, prefix: list[int]) -> bool:
        """Allocate the pages of the whole prompt (a remote prefill fills them at once) and start its job; False
        when they are short."""
        cached = len(prefix) * PAGE_SIZE
        if not self.cache.allocate(request, request.num_tokens - cached, prefix):
            return False
        request.num_computed_tokens = cached
        request.first_scheduled_time = time.monotonic()
        request.num_cached_tokens = min(cached, request.num_prompt_tokens)
        rid = request.request_id
        # the node decodes and encodes the images itself: their files travel (this side's encoder never runs)
        images = [WireImage(i.offset, i.num_tokens, i.digest, i.data) for i in request.images]
        future = self.client.submit(rid, request.prompt_token_ids, request.params, self.cache.page_table(request),
                                    len(prefix), self.timeout_s, images)
        self._jobs[rid] = (request, future)
        future.add_done_callback(lambda _: (self._done.put(rid), self._wake()))
        return True

    def _start_queued(self) -> None:
        """Start the queued requests' jobs, in arrival order, while job slots and pages allow."""
        while self._queued and len(self._jobs) < self.max_jobs:
            request = self._queued[0]
            if not self._launch(request, self.cache.match_prefix(request)):
                return
            self._queued.popleft()

    def _local(self, request: Request, reason: str) -> bool:
        self.num_fallbacks += 1
        log.warning("remote prefill fallback: prefilling locally", request_id=request.request_id, reason=reason)
        return False

    def _prefills_here(self, request: Request, start: int) -> bool:
        """Whether this engine can compute the request's prompt from position `start` on."""
        return self.encodes_images or all(i.offset + i.num_tokens <= start for i in request.images)

    def stats(self) -> dict[str, int | float]:
        return {"remote_prefills": self.num_remote, "remote_prefill_fallbacks": self.num_fallbacks,
                "remote_prefill_failures": self.num_failures, "remote_prefill_bytes": self.bytes_received,
                "remote_prefill_seconds": self.remote_seconds}

    def get(self, request_id: str) -> Request | None:
        job = self._jobs.get(request_id)
        if job is not None:
            return job[0]
        return next((r for r in self._queued if r.request_id == request_id), None)

    def live_requests(self) -> list[Request]:
        return [request for request, _ in self._jobs.values()] + list(self._queued)

    def drop(self, request: Request, reason: FinishReason) -> None:
        request.status, request.finish_reason, request.finish_time = RequestStatus.FINISHED, reason, time.monotonic()
        queued = next((i for i, r in enumerate(self._queued) if r is request), None)
        if queued is not None:
            del self._queued[queued]
            return
        if self._jobs.pop(request.request_id, None) is None:
            return
        cancel = self.client.cancel_async(request.request_id)
        cancel.add_done_callback(lambda _: (self._cancelled.put(request), self._wake()))

    def handovers(self) -> list[Handover]:
        while True:  # dropped requests' pages, now that no transfer writes them
            try:
                self.cache.free(self._cancelled.get_nowait())
            except queue.Empty:
                break
        out = []
        while True:
            try:
                rid = self._done.get_nowait()
            except queue.Empty:
                self._start_queued()  # the slots and pages the ended jobs left
                return out
            job = self._jobs.pop(rid, None)
            if job is None:
                continue  # dropped: the request is gone already
            request, future = job
            error = future.exception()
            if error is None:
                result = future.result()
                self.num_remote += 1
                self.bytes_received += result.bytes
                self.remote_seconds += result.seconds
                self.nodes_used[result.node] = self.nodes_used.get(result.node, 0) + 1
                # the pages hold the prompt: only now may the prefix cache share them
                request.num_computed_tokens = request.num_prompt_tokens
                self.cache.commit(request)
                out.append(Handover(request, SampledToken(result.first_token, result.first_logprob,
                                                          result.top_logprobs)))
                continue
            self.num_failures += 1
            if self.fallback == "local" and self._prefills_here(request, request.num_computed_tokens):
                # prefilled here, into the same pages
                self._local(request, f"the remote prefill failed: {error}")
                out.append(Handover(request))
            else:
                log.warning("remote prefill failed", request_id=rid, error=str(error))
                out.append(Handover(request, error=PrefillNodeError(
                    f"remote prefill failed and prefill_fallback is 'error': {error}")))

    def close(self) -> None:
        self.client.close()
