"""Prometheus metrics: counters follow the engine's stats, latency histograms count finished requests."""

from prometheus_client.parser import text_string_to_metric_families

from m3sdk import Engine


def samples(text: str) -> dict[str, float]:
    assert isinstance(text, str)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


async def test_metrics_follow_requests(engine_checkpoint):
    async with Engine(model=str(engine_checkpoint), device="cpu", max_model_len=128,
                      kv_cache_memory=1 << 21) as engine:
        before = samples(engine.metrics_text())
        assert before["m3sdk:generation_tokens_total"] == 0
        for max_tokens in (3, 5):
            done = await engine.generate("hello there", max_tokens=max_tokens, temperature=0, ignore_eos=True)
            assert len(done.token_ids) == max_tokens
        after = samples(engine.metrics_text())
        stats = engine.stats()
    assert after["m3sdk:generation_tokens_total"] == 8 == stats["generation_tokens"]
    assert after["m3sdk:prompt_tokens_total"] == stats["prompt_tokens"] > 0
    assert after["m3sdk:request_success_total{finished_reason=done}"] == 2
    assert after["m3sdk:time_to_first_token_seconds_count"] == 2
    assert after["m3sdk:e2e_request_latency_seconds_count"] == 2
    assert after["m3sdk:e2e_request_latency_seconds_sum"] >= after["m3sdk:time_to_first_token_seconds_sum"] > 0
    assert after["m3sdk:kv_cache_total_pages"] == stats["pages_total"]
    assert after["m3sdk:num_requests_running"] == 0
