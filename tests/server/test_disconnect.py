"""Leaving a stream early aborts its request and frees its pages; a full queue answers 503, not a hang."""

import json
import time

import httpx
import pytest
from conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "m3-tiny", "prompt": "Once upon a time, " * 20, "max_tokens": 900, "ignore_eos": True,
        "stream": True}


def _settled(server, aborted_before: float, expect: int) -> dict[str, float]:
    """Wait (bounded) until nothing runs or waits and `expect` more aborts are counted."""
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        idle = m["m3sdk:num_requests_running"] == 0 and m["m3sdk:num_requests_waiting"] == 0
        if idle and m['m3sdk:request_success_total{finished_reason="abort"}'] >= aborted_before + expect:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_client_disconnect_aborts_and_frees_every_page(server):
    before = server.metrics()
    with httpx.Client(base_url=server.base, headers=HEADERS, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = [next(lines) for _ in range(8)]
    assert all(e == "" or e.startswith("data: {") for e in events)
    after = _settled(server, before['m3sdk:request_success_total{finished_reason="abort"}'], 1)
    assert after["m3sdk:kv_cache_free_pages"] == after["m3sdk:kv_cache_total_pages"]
    # aborted long before its 900 tokens
    assert after["m3sdk:generation_tokens_total"] - before["m3sdk:generation_tokens_total"] < 600


def test_leaving_a_whole_response_aborts_it(server, device):
    before = server.metrics()
    body = {**LONG, "stream": False, "n": 2}
    # leave well before the 2 x 900 tokens are done: a GPU generates them in about a second
    wait = 0.1 if device.type == "cuda" else 1.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", headers=HEADERS, json=body, timeout=wait)
    after = _settled(server, before['m3sdk:request_success_total{finished_reason="abort"}'], 2)
    assert after["m3sdk:kv_cache_free_pages"] == after["m3sdk:kv_cache_total_pages"]
    assert after["m3sdk:generation_tokens_total"] - before["m3sdk:generation_tokens_total"] < 1200


def test_a_full_queue_is_a_503_and_the_streams_it_held_are_freed(server):
    before = server.metrics()
    with httpx.Client(base_url=server.base, headers=HEADERS, timeout=60) as http:
        streams = []
        try:
            for _ in range(6):  # max_num_seqs 4 + max_waiting_requests 2
                stream = http.stream("POST", "/v1/completions", json=LONG)
                response = stream.__enter__()
                streams.append(stream)
                assert response.status_code == 200
            refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "engine_overloaded" and "retry later" in error["message"]
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
    after = _settled(server, before['m3sdk:request_success_total{finished_reason="abort"}'], 6)
    assert after["m3sdk:kv_cache_free_pages"] == after["m3sdk:kv_cache_total_pages"]
    # the engine serves on
    ok = httpx.post(server.base + "/v1/completions", headers=HEADERS, json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] == 2
