"""m3-tiny's chat template: MiniMax-M3's layout, tools, tool calls, reasoning, thinking modes, and the round trip
from a rendered assistant turn back through the parser."""

import json
from pathlib import Path

import pytest
from chat_corpus import WEATHER

import m3sdk
from m3sdk.chat import (
    NS,
    parse_assistant,
    prompt_opens_reasoning,
    render_tool_calls,
    reply_prefix,
    starts_in_reasoning,
    validate_messages,
)
from m3sdk.errors import InvalidRequestError
from m3sdk.tokenizer import Tokenizer

ASSETS = Path(m3sdk.__file__).parent / "assets" / "m3-tiny"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tk() -> Tokenizer:
    return Tokenizer.from_pretrained(ASSETS)


def test_plain_conversation_keeps_the_trained_layout(tk):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Good day."}, {"role": "user", "content": [
                    {"type": "text", "text": "Go "}, {"type": "text", "text": "on"}]}]
    assert tk.apply_chat_template(messages) == ("]~!b[]~b]system\nBe brief.[e~[\n]~b]user\nHello[e~[\n]~b]ai\n"
                                                "Good day.[e~[\n]~b]user\nGo on[e~[\n]~b]ai\n")
    assert tk.apply_chat_template(messages[1:2], add_generation_prompt=False) == "]~!b[]~b]user\nHello[e~[\n"
    dev = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert tk.apply_chat_template(dev) == "]~!b[]~b]developer\nAnswer in French.[e~[\n]~b]user\nHi[e~[\n]~b]ai\n"


def test_tools_are_listed_in_the_system_turn(tk):
    text = tk.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  tools=[WEATHER, SEARCH])
    system = text[len("]~!b[]~b]system\n"):text.index("[e~[")]
    assert system.startswith("Be brief.\n\n")
    lines = [line for line in system.split("\n") if line.startswith("<tool>")]
    assert [json.loads(line[len("<tool>"):-len("</tool>")]) for line in lines] == [WEATHER["function"],
                                                                                  SEARCH["function"]]
    # without a system message the tools still make a system turn
    assert tk.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[SEARCH]).startswith(
        "]~!b[]~b]system\n# Tools\n")


@pytest.mark.parametrize("mode", [None, "adaptive", "enabled", "disabled"])
def test_thinking_modes_prefill_the_reply(tk, mode):
    kwargs = {} if mode is None else {"chat_template_kwargs": {"thinking_mode": mode}}
    text = tk.apply_chat_template([{"role": "user", "content": "Hi"}], **kwargs)
    assert text == "]~!b[]~b]user\nHi[e~[\n]~b]ai\n" + reply_prefix(mode)
    assert prompt_opens_reasoning(text) == starts_in_reasoning(mode) == (mode == "enabled")


def test_bad_messages_and_kwargs_are_request_errors(tk):
    user = [{"role": "user", "content": "Hi"}]
    bad_calls = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    for messages in ([], "hi", [{"role": "robot", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                     [{"role": "user", "content": 3}], bad_calls,
                     [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]):
        with pytest.raises(InvalidRequestError):
            tk.apply_chat_template(messages)
    with pytest.raises(InvalidRequestError, match="thinking_mode"):
        tk.apply_chat_template(user, chat_template_kwargs={"thinking_mode": "always"})
    with pytest.raises(InvalidRequestError, match="cannot set"):
        tk.apply_chat_template(user, chat_template_kwargs={"tools": []})
    for tools in ("x", [{"function": {}}], [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(InvalidRequestError):
            tk.apply_chat_template(user, tools=tools)


def test_markers_encode_as_plain_text(tk):
    """The namespace and think tags are not special tokens of m3-tiny: they survive skip_special_tokens."""
    text = f"<mm:think>x</mm:think>{render_tool_calls([('search', {'query': 'café ☕', 'limit': 2})])}"
    ids = tk.encode(text, add_special_tokens=False)
    assert tk.decode(ids, skip_special_tokens=True) == text
    assert NS in tk.decode(tk.encode(NS, add_special_tokens=False))


def test_assistant_turn_round_trips_through_the_parser(tk):
    arguments = [{"city": "Zürich", "days": 3, "metric": False, "hours": [6, 12.5],
                  "where": {"lat": 47.37, "label": None}},
                 {"city": "Paris <centre>", "days": 1}]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(a)}}
             for i, a in enumerate(arguments)]
    calls.append({"id": "call_2", "type": "function", "function": {"name": "search",
                                                                   "arguments": {"query": "rain", "limit": 5}}})
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.",
                 "tool_calls": calls}]
    history = tk.apply_chat_template(messages, tools=[WEATHER, SEARCH], add_generation_prompt=False)
    turn = history[history.rindex("]~b]ai\n") + len("]~b]ai\n"):-len("[e~[\n")]
    expected_calls = [("get_weather", a) for a in arguments] + [("search", {"query": "rain", "limit": 5})]
    assert render_tool_calls(expected_calls) in turn
    message = parse_assistant(turn, [WEATHER, SEARCH])
    assert message.content == "Checking both." and message.reasoning_content == "Two cities."
    expected = [("get_weather", {**arguments[0], "where": {"lat": 47.37}}), *expected_calls[1:]]  # None dropped
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    # the parsed message, sent back as history, renders the same turn
    again = validate_messages([messages[0], message.to_dict()])
    assert tk.apply_chat_template(again, tools=[WEATHER, SEARCH], add_generation_prompt=False) == history


def test_reasoning_kept_only_after_the_last_user_turn(tk):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "r2"},
                {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"}]
    text = tk.apply_chat_template(messages)
    assert "r1" not in text and "<mm:think>\nr2\n</mm:think>\nd[e~[\n" in text
    assert "]~b]tool\n<response>t1</response>\n<response>t2</response>[e~[\n]~b]ai\n" in text
