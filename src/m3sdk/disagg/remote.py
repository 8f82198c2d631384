"""The decode engine core's side of remote prefill (called from the engine thread only).

The scheduler asks `wants(request, cached_tokens)` when it admits a request; if so it allocates the request's
pages for the whole prompt and calls `start`, then leaves the request alone. The job runs on the disagg loop;
when it ends the core is woken, `poll` hands over the outcome, and the core either appends the first token
(the pages are valid from then on) or falls back to local prefill into the same pages (or fails the request
with PrefillNodeError). `cancel` (called before a request's pages are freed) returns once the transfer can no
longer write them.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from m3sdk.cache.manager import CacheManager
from m3sdk.disagg import wire
from m3sdk.disagg.client import PrefillClient, RemotePrefillResult
from m3sdk.disagg.compat import CompatInfo, model_fingerprint
from m3sdk.observability import get_logger
from m3sdk.request import FinishReason, Request

log = get_logger("m3sdk.disagg.remote")

Outcome = RemotePrefillResult | BaseException


class RemotePrefill:
    def __init__(self, client: PrefillClient, min_tokens: int, fallback: str, timeout_s: float,
                 wake: Callable[[], None]):
        self.client, self.min_tokens, self.fallback, self.timeout_s = client, min_tokens, fallback, timeout_s
        self._wake = wake
        self._jobs: dict[str, tuple[Request, Future]] = {}
        self._done: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.num_remote = self.num_fallbacks = 0
        self.nodes_used: dict[str, int] = {}  # node -> remote prefills it served

    @classmethod
    def from_config(cls, config, cache: CacheManager, vocab_size: int, wake: Callable[[], None]) -> RemotePrefill:
        compat = CompatInfo.from_spec(cache.kv.spec, model_fingerprint(config.model_path()))
        root = config.prefill_tls_root_cert
        client = PrefillClient(list(config.prefill_nodes), compat, wire.page_rows(cache.kv), vocab_size,
                               token=config.prefill_token, tls_root_certificates=Path(root).read_bytes() if root
                               else None)
        try:
            client.start()
        except BaseException:  # e.g. an incompatible node: close the listener and channels opened so far
            client.close()
            raise
        return cls(client, config.remote_prefill_min_tokens, config.prefill_fallback, config.prefill_timeout, wake)

    def wants(self, request: Request, cached_tokens: int) -> bool:
        # a preempted request has generated tokens to recompute too: that is local work
        if request.num_output_tokens or request.num_prompt_tokens - cached_tokens < self.min_tokens:
            return False
        # with every node down, prefill locally at once rather than fail each request on the way
        return self.client.has_healthy_node or self.fallback == "error"

    def start(self, request: Request, pages: list[int], num_cached_pages: int) -> None:
        rid = request.request_id
        future = self.client.submit(rid, request.prompt_token_ids, request.params, pages, num_cached_pages,
                                    self.timeout_s)
        self._jobs[rid] = (request, future)
        future.add_done_callback(lambda _: (self._done.put(rid), self._wake()))

    def poll(self) -> list[tuple[Request, Outcome]]:
        out = []
        while True:
            try:
                rid = self._done.get_nowait()
            except queue.Empty:
                return out
            job = self._jobs.pop(rid, None)
            if job is None or job[1].cancelled():
                continue  # cancelled: the request is gone already
            request, future = job
            error = future.exception()
            if error is None:
                result = future.result()
                self.num_remote += 1
                self.nodes_used[result.node] = self.nodes_used.get(result.node, 0) + 1
                out.append((request, result))
            else:
                self.num_fallbacks += 1
                log.warning("remote prefill failed", request_id=rid, error=str(error), fallback=self.fallback)
                out.append((request, error))

    def on_finish(self, request: Request, reason: FinishReason) -> None:
        """A finish hook of the core: a request leaving mid-transfer stops the transfer first."""
        if self._jobs.pop(request.request_id, None) is not None:
            self.client.cancel(request.request_id)

    def close(self) -> None:
        self.client.close()
