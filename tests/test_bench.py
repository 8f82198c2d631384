"""`m3sdk bench`: the metric arithmetic on known numbers, and real runs of the command against the embedded engine
(the bundled m3-tiny when its assets are present, else the oracle checkpoint with a byte tokenizer)."""

import json
import math
import random

import pytest

from m3sdk.bench import RequestResult, compute_metrics, random_requests
from m3sdk.cli import main
from m3sdk.config import BUNDLED_MODELS


@pytest.fixture(scope="module")
def bench_model(engine_checkpoint):
    if (BUNDLED_MODELS["m3-tiny"] / "config.json").is_file():
        return "m3-tiny"
    return str(engine_checkpoint)



def test_metrics_on_known_numbers():
    results = [
        RequestResult(True, 10, 5, ttft=0.1, itl=[0.05, 0.05, 0.05, 0.05], latency=0.3),  # tpot 50 ms
        RequestResult(True, 20, 3, ttft=0.4, itl=[0.1, 0.1], latency=0.6),  # tpot 100 ms
        RequestResult(False, 30, 0, error="boom"),
    ]
    m = compute_metrics(results, duration=2.0, percentiles=(50, 99), slo_ms={"ttft": 200, "tpot": 60})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 300 * 0.99)
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["mean_itl_ms"] == pytest.approx((4 * 50 + 2 * 100) / 6)
    assert m["p50_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx(450.0)
    # only the first request meets both SLOs; the failed one counts against the fraction
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["goodput_fraction"] == pytest.approx(1 / 3)


def test_random_lengths_stay_in_range():
    reqs = random_requests(200, 100, 20, 0.25, vocab_size=50, seed=1)
    assert {len(r.prompt) for r in reqs} <= set(range(75, 126)) and min(len(r.prompt) for r in reqs) < 90
    assert all(r.prompt_len == len(r.prompt) and 15 <= r.output_len <= 25 for r in reqs)
    assert all(0 <= t < 50 for r in reqs for t in r.prompt)


def _bench(model, tmp_path, *extra):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", model, "--num-prompts", "8", "--input-len", "24", "--output-len", "6",
            "--range-ratio", "0.5", "--num-warmups", "1", "--max-num-seqs", "8", "--json", str(out),
            "--metric-percentiles", "50,99", *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_fixed_concurrency_sweep(bench_model, tmp_path):
    runs = _bench(bench_model, tmp_path, "--max-concurrency", "1,8", "--slo-ttft-ms", "100000",
                  "--slo-tpot-ms", "100000", "--save-detailed")
    assert [r["max_concurrency"] for r in runs] == [1, 8]
    for r in runs:
        assert r["backend"] == "m3sdk" and r["completed"] == 8 and r["failed"] == 0
        # EOS is ignored: every request generates exactly its drawn length
        assert r["total_output_tokens"] == sum(r["output_lens"]) and all(3 <= n <= 9 for n in r["output_lens"])
        assert r["total_input_tokens"] == sum(r["input_lens"]) and all(12 <= n <= 36 for n in r["input_lens"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
        assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
        assert r["total_token_throughput"] == pytest.approx(
            (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
        assert r["engine_steps"] > 0
    serial, parallel = runs
    # one request at a time: the requests' latencies tile the run; 8 at once share steps (fewer steps)
    assert serial["mean_e2el_ms"] * 8 / 1000 <= serial["duration"] * 1.01
    assert parallel["engine_steps"] < serial["engine_steps"]


def test_bench_poisson_arrivals_take_their_time(bench_model, tmp_path):
    rate = 40.0
    (r,) = [_bench(bench_model, tmp_path, "--request-rate", str(rate), "--seed", "3")]
    # the gaps the run drew (same generator, same seed) bound its duration from below
    rng = random.Random(3)
    gaps = sum(rng.gammavariate(1.0, 1.0 / rate) for _ in range(7))
    assert r["request_rate"] == rate and r["completed"] == 8
    assert r["duration"] >= gaps
    assert math.isfinite(r["p99_e2el_ms"])
