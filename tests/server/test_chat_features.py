"""Chat features through the official `openai` client and LangChain: reasoning split from content (whole and
streamed, no markup in either), response_format / guided_* constraining the reply, tools rendered and parsed."""

import json
import re

import jsonschema
import openai
import pytest
from conftest import API_KEY

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe Emma Woodhouse."}]
MARKUP = re.compile(r"mm:think|<think>|tool_call|<invoke|\]<\]minimax\[>\[")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


def test_response_format_json_schema_gives_valid_json(client):
    for seed in range(4):
        done = client.chat.completions.create(
            model="m3-tiny", messages=ASK, max_tokens=48, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)


def test_response_format_streamed_equals_whole(client):
    args = dict(model="m3-tiny", messages=ASK, max_tokens=48, temperature=0.8, seed=5,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["Elizabeth", "Darcy"]}, lambda t: t in ("Elizabeth", "Darcy")),
    ({"guided_regex": r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,2}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,2}", t)),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_structured_fields(client, extra, check):
    chat = client.chat.completions.create(model="m3-tiny", messages=ASK, max_tokens=40, seed=1, extra_body=extra)
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    text = client.completions.create(model="m3-tiny", prompt="Name:", max_tokens=40, seed=2, extra_body=extra)
    assert check(text.choices[0].text), text.choices[0].text


def test_two_constraints_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m3-tiny", messages=ASK, extra_body={"guided_regex": "a", "guided_choice":
                                                                                  ["b"]})
    assert "one structured-output constraint" in e.value.message


def test_reasoning_is_split_from_content_whole_and_streamed(client):
    args = dict(model="m3-tiny", messages=ASK, max_tokens=32, temperature=0,
                extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    whole = client.chat.completions.create(**args).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and not MARKUP.search(reasoning) and not MARKUP.search(whole.content or "")
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_reasoning == reasoning and streamed_content == (whole.content or "")


def test_tools_are_rendered_and_a_reply_without_calls_is_content(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    plain = client.chat.completions.create(model="m3-tiny", messages=ASK, max_tokens=8, temperature=0)
    with_tools = client.chat.completions.create(model="m3-tiny", messages=ASK, max_tokens=8, temperature=0,
                                                tools=tools)
    # the tool list is part of the prompt
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    message = with_tools.choices[0].message
    assert not MARKUP.search(message.content or "")
    # a previous turn's call and its result go back in
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain."}]
    again = client.chat.completions.create(model="m3-tiny", messages=history, max_tokens=4, tools=tools)
    assert again.usage.prompt_tokens > with_tools.usage.prompt_tokens
