"""engine.chat / chat_stream on the bundled m3-tiny: tool_choice "required" and a named function always give a
parseable call of an allowed tool with schema-valid arguments and finish_reason "tool_calls" (m3-tiny never calls
tools of its own accord, so the grammar alone makes it); response_format gives schema-valid JSON; streaming
deltas join into the whole reply; bad tool_choice / response_format are refused before queueing."""

import asyncio
import json

import jsonschema
import pytest

from m3sdk import Engine
from m3sdk.chat import join_deltas
from m3sdk.chat.constraints import tool_call_grammar
from m3sdk.errors import InvalidRequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 6},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"enum": ["c", "f"]}},
               "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {
    "utc": {"type": "boolean"}}, "required": ["utc"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Bath?"}]


def check_calls(completion, allowed) -> None:
    assert completion.finish_reason == "tool_calls", completion.text
    calls = completion.message.tool_calls
    assert calls and completion.message.content is None
    for call in calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_and_named_tool_choice_always_give_a_valid_call():
    async with Engine(device="cpu") as e:
        done = await asyncio.gather(*[e.chat(MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=i,
                                             max_tokens=320, parallel_tool_calls=False) for i in range(20)])
        for c in done:
            check_calls(c, SCHEMAS)
            assert len(c.message.tool_calls) == 1
        # parallel calls: m3-tiny may chain several; each one parsed is valid
        parallel = await e.chat(MESSAGES, tools=TOOLS, tool_choice="required", seed=1, max_tokens=320)
        assert parallel.message.tool_calls
        for call in parallel.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        named = {"type": "function", "function": {"name": "now"}}
        done = await asyncio.gather(*[e.chat(MESSAGES, tools=TOOLS, tool_choice=named, temperature=1.0, seed=i,
                                             max_tokens=200) for i in range(4)])
        for c in done:
            check_calls(c, {"now"})
            assert len(c.message.tool_calls) == 1


async def test_streamed_deltas_join_into_the_whole_reply():
    async with Engine(device="cpu") as e:
        whole = await e.chat(MESSAGES, tools=TOOLS, tool_choice="required", seed=3, max_tokens=320,
                             parallel_tool_calls=False)
        chunks = [c async for c in e.chat_stream(MESSAGES, tools=TOOLS, tool_choice="required", seed=3,
                                                 max_tokens=320, parallel_tool_calls=False)]
        joined = join_deltas([d for c in chunks for d in c.deltas])
        assert chunks[-1].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert [(t.function.name, t.function.arguments) for t in joined.tool_calls] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert all(d.index == i for i, d in enumerate(d for c in chunks for x in c.deltas for d in x.tool_calls
                                                      if d.id is not None))
        plain = await e.chat(MESSAGES, seed=0, max_tokens=12, chat_template_kwargs={"thinking_mode": "disabled"})
        assert plain.finish_reason == "length" and plain.message.content and not plain.message.tool_calls


async def test_response_format_constrains_the_reply_to_json():
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "cross"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["mood", "score"], "additionalProperties": False}
    async with Engine(device="cpu") as e:
        done = await asyncio.gather(*[e.chat(MESSAGES, response_format={"type": "json_schema", "json_schema": {
            "name": "mood", "schema": schema}}, seed=i, max_tokens=40) for i in range(6)])
        for c in done:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)


async def test_bad_chat_requests_are_refused_before_queueing():
    async with Engine(device="cpu") as e:
        for kwargs in (dict(tool_choice="always", tools=TOOLS), dict(tool_choice="required"),
                       dict(tool_choice={"type": "function", "function": {"name": "missing"}}, tools=TOOLS),
                       dict(response_format={"type": "xml"}),
                       dict(response_format={"type": "json_object"}, tool_choice="required", tools=TOOLS),
                       dict(response_format={"type": "json_object"},
                            chat_template_kwargs={"thinking_mode": "enabled"}),
                       dict(response_format={"type": "json_object"}, structured_output={"regex": "a"})):
            with pytest.raises(InvalidRequestError):
                await e.chat(MESSAGES, **kwargs)
        with pytest.raises(InvalidRequestError):
            await e.chat([{"role": "robot", "content": "hi"}])
        assert e.stats()["steps"] == 0


def test_tool_call_grammar_shape():
    grammar = tool_call_grammar(TOOLS, ["get_weather"], parallel=False)
    assert grammar.startswith('root ::= "]<]minimax[>[<tool_call>\\n" call "]<]minimax[>[</tool_call>"')
    assert '"1" | "2" | "3" | "4" | "5" | "6" | "7"' in grammar and "now" not in grammar
