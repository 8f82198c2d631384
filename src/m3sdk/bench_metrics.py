"""The metrics of a `m3sdk bench` run under vLLM benchmark_serving's names: latencies (TTFT, TPOT, ITL, E2EL) in
ms as mean / median / std / percentiles, throughputs per second, goodput against SLOs, and why requests failed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from m3sdk.bench import RequestResult

_LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def failure_reasons(results: Sequence[RequestResult]) -> dict[str, int]:
    """Why requests failed: each distinct error with how many requests it ended, most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            reason = r.error or "no tokens generated"
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _summary(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of seconds, in ms, under vLLM's names (`mean_ttft_ms`, `p99_ttft_ms`, ...)."""
    ms = sorted(v * 1000.0 for v in values_s)
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = _percentile(ms, p)
    return out


def _percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def compute_metrics(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (99,),
                    slo_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's metrics under vLLM benchmark_serving's names (latencies in ms, throughputs per second)."""
    done = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slo_ms:
        good = sum(1 for r in done if _meets(r, slo_ms))
        metrics["request_goodput"] = good / duration
        metrics["goodput_fraction"] = good / len(results) if results else 0.0
    series = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [g for r in done for g in r.itl],
              "e2el": [r.latency for r in done]}
    for name in _LATENCY_METRICS:
        metrics.update(_summary(name, series[name], percentiles))
    return metrics


def _meets(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "e2el": r.latency,
              "tpot": (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0}
    return all(values[k] * 1000.0 <= limit for k, limit in slo_ms.items())
