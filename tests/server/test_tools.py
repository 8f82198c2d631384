"""Tool calls through real clients: the official `openai` client with tool_choice "required" or a named function
(schema-valid arguments, streamed as indexed tool_call deltas with no markup in content), and LangChain's
ChatOpenAI(...).bind_tools(...)."""

import json

import jsonschema
import openai
import pytest
from conftest import API_KEY
from pydantic import BaseModel, Field

ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI  # the test extra has it; a bare GPU host may not

ORDER = {"type": "object", "properties": {
    "sku": {"type": "string", "maxLength": 6},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
    "gift": {"type": "boolean"}},
    "required": ["sku", "quantity"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "create_order", "description": "Order an item",
                                           "parameters": ORDER}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}}]
SCHEMAS = {"create_order": ORDER, "get_weather": WEATHER}
ASK = [{"role": "user", "content": "Order two books for Miss Bates."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice_gives_schema_valid_calls(client, seed):
    done = client.chat.completions.create(model="m3-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=320, temperature=1.0, seed=seed)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert not choice.message.content
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_streamed_as_indexed_deltas_equals_whole(client):
    args = dict(model="m3-tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.7, seed=4,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    assert [c.function.name for c in whole] == ["get_weather"]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == whole[0].function.arguments
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_an_unknown_named_tool_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m3-tiny", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "fly"}})


class GetWeather(BaseModel):
    """Weather of a city."""

    city: str = Field(max_length=6)  # bounded: the grammar enforces it, so a sample fits in max_tokens


def test_langchain_bind_tools_gets_a_tool_call(server):
    llm = ChatOpenAI(model="m3-tiny", base_url=server.base + "/v1", api_key=API_KEY, temperature=0.7, max_tokens=320,
                     seed=3, max_retries=0)
    bound = llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False)
    reply = bound.invoke("What is the weather in Bath?")
    assert [c["name"] for c in reply.tool_calls] == ["GetWeather"] and not reply.invalid_tool_calls
    GetWeather(**reply.tool_calls[0]["args"])
    streamed = None
    for piece in llm.bind_tools([GetWeather], tool_choice="GetWeather").stream("Weather in York?"):
        streamed = piece if streamed is None else streamed + piece
    assert [c["name"] for c in streamed.tool_calls] == ["GetWeather"]
    GetWeather(**streamed.tool_calls[0]["args"])
