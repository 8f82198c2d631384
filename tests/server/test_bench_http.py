"""`m3sdk bench --base-url` drives the server over HTTP with the workload the embedded bench runs."""

import json

from conftest import API_KEY

from m3sdk.cli import main


def test_bench_drives_an_openai_endpoint(server, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "--base-url", server.base + "/v1", "--api-key", API_KEY, "--num-prompts", "6",
            "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5", "--max-concurrency", "1,3",
            "--json", str(out), "--save-detailed", "--metric-percentiles", "50,99"]
    assert main(argv) == 0
    runs = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in runs] == [1, 3]
    for r in runs:
        assert r["backend"] == "openai-http" and r["completed"] == 6 and r["failed"] == 0, r["errors"]
        # ignore_eos reaches the server: every request generates exactly its drawn length, as the usage says
        assert r["total_output_tokens"] == sum(r["output_lens"]) and all(4 <= n <= 12 for n in r["output_lens"])
        assert r["total_input_tokens"] == sum(r["input_lens"]) and all(12 <= n <= 36 for n in r["input_lens"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
        assert r["mean_ttft_ms"] < r["mean_e2el_ms"]


def test_a_refused_endpoint_fails_the_bench_with_the_reason(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--base-url", server.base + "/v1", "--api-key", "wrong", "--served-model", "m3-tiny",
            "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--num-warmups", "0", "--json", str(out),
            "--save-detailed"]
    assert main(argv) == 1
    assert "HTTP 401" in capsys.readouterr().err
    run = json.loads(out.read_text())
    assert run["completed"] == 0 and run["failed"] == 2 and all("HTTP 401" in e for e in run["errors"])
