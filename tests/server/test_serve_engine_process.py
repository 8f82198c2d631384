"""`m3sdk serve --engine-process` (the engine core in a process of its own) answers the official `openai` client
as the in-thread server does: the same greedy text, streamed and whole, the same errors."""

import openai
import pytest
from conftest import API_KEY, Server

CHAT = [{"role": "user", "content": "Tell me about Emma."}]


@pytest.fixture(scope="module")
def process_server():
    srv = Server("--api-key", API_KEY, "--max-num-seqs", "4", "--engine-process")
    yield srv
    out = srv.stop()
    assert "Traceback" not in out, out


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


def test_the_engine_process_server_answers_as_the_thread_one(server, process_server):
    ours, theirs = client(process_server), client(server)
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
