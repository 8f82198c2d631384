"""The official `openai` client against `m3sdk serve` (m3-tiny): chat, completions, models, errors."""

import httpx
import openai
import pytest
from conftest import API_KEY

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about Emma."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_names(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["m3-tiny", "minimax-m3-tiny"]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_chat_plain(client):
    done = client.chat.completions.create(model="m3-tiny", messages=CHAT, max_tokens=12, temperature=0)
    choice = done.choices[0]
    assert done.object == "chat.completion" and done.model == "m3-tiny"
    assert choice.message.role == "assistant" and len(choice.message.content) > 5
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens > 10 and done.usage.total_tokens == done.usage.prompt_tokens + 12


def test_chat_answers_to_a_second_name(client):
    done = client.chat.completions.create(model="minimax-m3-tiny", messages=CHAT, max_tokens=2)
    assert done.model == "m3-tiny" and done.usage.completion_tokens == 2


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 7)])
def test_chat_stream_equals_whole(client, temperature, seed):
    args = dict(model="m3-tiny", messages=CHAT, max_completion_tokens=24, temperature=temperature, seed=seed)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n2_with_a_seed(client, device):
    args = dict(model="m3-tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=3, n=2)
    done = client.chat.completions.create(**args)
    assert [c.index for c in done.choices] == [0, 1]
    texts = [c.message.content for c in done.choices]
    assert texts[0] != texts[1]  # seed + i per choice
    assert done.usage.completion_tokens == 32
    again = client.chat.completions.create(**args, stream=True)
    streamed = ["", ""]
    for chunk in again:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    # both choices stream under their index; equal to the whole reply where the numerics do not depend on how the
    # choices were batched (a GPU's bf16 sums do; one seeded choice is compared there: test_chat_stream_equals_whole)
    assert all(streamed) and (streamed == texts or device.type == "cuda")


def test_chat_logprobs(client):
    done = client.chat.completions.create(model="m3-tiny", messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == done.choices[0].message.content
    for t in content:  # greedy: the sampled token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0


def test_completions_text_and_token_prompts(client):
    whole = client.completions.create(model="m3-tiny", prompt=["Once upon a time", "It was"], max_tokens=8,
                                      temperature=0, logprobs=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 8 for c in whole.choices)
    assert "".join(whole.choices[0].logprobs.tokens) == whole.choices[0].text
    streamed = ["", ""]
    for chunk in client.completions.create(model="m3-tiny", prompt=["Once upon a time", "It was"], max_tokens=8,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in whole.choices]
    # streamed logprobs: every token once, its text offset counting the choice's text before it
    tokens, offsets, texts = [[], []], [[], []], ["", ""]
    for chunk in client.completions.create(model="m3-tiny", prompt=["Once upon a time", "It was"], max_tokens=8,
                                           temperature=0, logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                assert c.logprobs.text_offset[0] == len(texts[c.index])
                tokens[c.index] += c.logprobs.tokens
                offsets[c.index] += c.logprobs.text_offset
            texts[c.index] += c.text
    assert texts == streamed and [len(t) for t in tokens] == [8, 8]
    assert ["".join(t) for t in tokens] == texts
    assert all(o == [sum(map(len, t[:i])) for i in range(8)] for o, t in zip(offsets, tokens, strict=True))
    ids = client.completions.create(model="m3-tiny", prompt=[0, 100, 200, 300], max_tokens=3)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3


def test_bad_input_is_a_400_with_the_engine_text(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m3-tiny", messages=CHAT, temperature=-1)
    assert "temperature must be" in e.value.message and "got -1.0" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m3-tiny", prompt="hi", max_tokens=100000)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m3-tiny", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"].startswith("messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m3-tiny", messages=CHAT, logit_bias={"x": 10})
    assert e.value.body["param"] == "logit_bias"


def test_logit_bias_and_min_tokens_reach_the_engine(client):
    """A +100 bias on one token makes greedy decoding repeat it; min_tokens keeps a reply going past its stop."""
    forced = client.completions.create(model="m3-tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logit_bias={"120": 100}, logprobs=1)
    assert len(forced.choices[0].logprobs.tokens) == 6 and len(set(forced.choices[0].logprobs.tokens)) == 1
    free = client.completions.create(model="m3-tiny", prompt="Once upon a time", max_tokens=24, temperature=0)
    stop = free.choices[0].text[2:4]
    early = client.completions.create(model="m3-tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                      stop=[stop])
    held = client.completions.create(model="m3-tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                     stop=[stop], extra_body={"min_tokens": 12})
    assert early.usage.completion_tokens < 12 <= held.usage.completion_tokens


def test_a_wrong_or_missing_key_is_a_401(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    assert httpx.post(server.base + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # probes need no key


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"
