"""`m3sdk serve` with its engine core in a process of its own (the default) answers the official `openai` client
as a server with the core in a thread of its own process (`--no-engine-process`) does: the same greedy text,
streamed and whole, the same errors."""

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY
from server_process import Server

CHAT = [{"role": "user", "content": "Tell me about Emma."}]


def _module_server(*args: str):
    srv = Server("--api-key", API_KEY, "--max-num-seqs", "4", *args)
    yield srv
    out = srv.stop()
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def process_server():
    yield from _module_server()


@pytest.fixture(scope="module")
def thread_server():
    yield from _module_server("--no-engine-process")


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


def test_the_engine_process_server_answers_as_the_thread_one(thread_server, process_server):
    ours, theirs = client(process_server), client(thread_server)
    args = dict(model="m3-tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    want = theirs.completions.create(**args)
    got = ours.completions.create(**args)
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in ours.completions.create(**args, stream=True) if c.choices)
    assert streamed == want.choices[0].text
    chat = dict(model="m3-tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert ours.chat.completions.create(**chat).choices[0].message.content == \
        theirs.chat.completions.create(**chat).choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        ours.completions.create(model="m3-tiny", prompt="x", max_tokens=10**6)
    # the child's counters, scraped in the server's process
    assert process_server.metrics()['m3sdk:request_success_total{finished_reason="done"}'] == 3.0


def engine_child(pid: int) -> int:
    """The server's engine process (beside it, multiprocessing's resource tracker); a thread of the server started
    it, and /proc lists children under the thread that made them."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    (child,) = [int(c) for c in children
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return child


@pytest.mark.skipif(sys.platform != "linux", reason="finds the engine process through /proc")
def test_killing_the_engine_process_fails_streams_and_health(process_server):
    """Last in this module: the server's engine is dead after it."""
    ours = client(process_server)
    stream = ours.completions.create(model="m3-tiny", prompt="A long story", max_tokens=200, stream=True,
                                     extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    os.kill(engine_child(process_server.proc.pid), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    assert httpx.get(process_server.base + "/health", timeout=10).status_code == 503
    with pytest.raises(openai.InternalServerError):
        ours.completions.create(model="m3-tiny", prompt="after", max_tokens=2)
