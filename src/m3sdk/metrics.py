"""Prometheus metrics of one engine, named as vLLM names them (with an `m3sdk:` prefix).

Counters and gauges are read from the core's published stats at scrape time, so the engine loop pays nothing
for them; latency histograms are observed once per request, when it finishes. Each engine has its own registry:
an application that runs several engines, or none, keeps the global registry clean. Expose it with
`engine.metrics_text()` from your own HTTP handler, or `prometheus_client.start_http_server(port,
registry=engine.metrics_registry)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from m3sdk.request import FinishReason, Request

PREFIX = "m3sdk:"

# stats key -> (metric name, help); counters get `_total` appended by the exposition format
_GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "pages_free": ("kv_cache_free_pages", "KV-cache pages a request could take (free or idle cached)."),
    "pages_total": ("kv_cache_total_pages", "KV-cache pages in the pool (16 token slots each)."),
}
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens received."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "preemptions": ("num_preemptions", "Requests preempted (recomputed later) when pages ran out."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_drafted_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."),
    # with prefill_nodes (m3sdk/disagg/remote.py)
    "remote_prefills": ("remote_prefills", "Prompts prefilled on a remote prefill node."),
    "remote_prefill_fallbacks": ("remote_prefill_fallbacks",
                                 "Prompts long enough for a remote node that were prefilled here instead."),
    "remote_prefill_failures": ("remote_prefill_failures", "Remote prefills that failed (then fell back or failed "
                                "their request)."),
    "remote_prefill_bytes": ("remote_prefill_bytes", "KV and index-key bytes received from prefill nodes."),
    "remote_prefill_seconds": ("remote_prefill_seconds", "Time remote prefills took, call to first token back "
                               "(node compute and transfer overlap)."),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=stats.get(key, 0))
        for key, (name, doc) in _COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=stats[key])
        finished = CounterMetricFamily(PREFIX + "request_success", "Requests ended, by reason.",
                                       labels=["finished_reason"])
        finished.add_metric(["done"], stats.get("requests_finished", 0))
        finished.add_metric(["abort"], stats.get("requests_aborted", 0))
        yield finished


class EngineMetrics:
    """Owns one engine's registry. `on_finish` is the core's finish hook."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self._tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.")
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self._queue = histogram("request_queue_time_seconds", "Arrival to first schedule.")

    def on_finish(self, request: Request, reason: FinishReason) -> None:
        t = request.timings()
        self._e2e.observe(t.e2e_s)
        self._queue.observe(t.queue_s)
        if t.ttft_s is not None:
            self._ttft.observe(t.ttft_s)
        if t.mean_tpot_s is not None:
            self._tpot.observe(t.mean_tpot_s)

    def text(self) -> str:
        """The Prometheus exposition format."""
        return generate_latest(self.registry).decode()
