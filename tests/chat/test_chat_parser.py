"""The reply parsers on the corpus: parse_assistant gives the expected message, and AssistantStreamParser gives
the same message whatever the cuts (every single cut, every character, m3-tiny's tokens, random cuts), never
sending a partial marker or reasoning into content."""

import json
import random
from pathlib import Path

import pytest
from chat_corpus import CORPUS

import m3sdk
from m3sdk.chat import AssistantMessage, AssistantStreamParser, join_deltas, parse_assistant, render_tool_call
from m3sdk.params import SamplingParams
from m3sdk.tokenizer import TextStream, Tokenizer

IDS = [c["id"] for c in CORPUS]


def _summary(message: AssistantMessage) -> tuple:
    return message.content, message.reasoning_content, [(c.function.name, c.function.arguments)
                                                        for c in message.tool_calls]


def _streamed(case: dict, pieces: list[str]) -> AssistantMessage:
    parser = AssistantStreamParser(case["tools"], starts_in_reasoning=case["starts_in_reasoning"])
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    for d in deltas:  # each delta carries one kind of thing
        assert sum(x is not None and x != [] for x in (d.content, d.reasoning_content, d.tool_calls)) == 1
    assert [t.index for d in deltas for t in d.tool_calls] == list(range(len(join_deltas(deltas).tool_calls)))
    return join_deltas(deltas)


def test_corpus_size():
    assert len(CORPUS) >= 40 and len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_whole(case):
    message = parse_assistant(case["text"], case["tools"], starts_in_reasoning=case["starts_in_reasoning"])
    expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a in case["calls"]]
    assert _summary(message) == (case["content"], case["reasoning"], expected)
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_stream_every_cut(case):
    text, whole = case["text"], parse_assistant(case["text"], case["tools"],
                                                starts_in_reasoning=case["starts_in_reasoning"])
    for cut in range(len(text) + 1):
        assert _summary(_streamed(case, [text[:cut], text[cut:]])) == _summary(whole), cut
    assert _summary(_streamed(case, list(text))) == _summary(whole)
    rng = random.Random(case["id"])
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _summary(_streamed(case, pieces)) == _summary(whole), cuts


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_pretrained(Path(m3sdk.__file__).parent / "assets" / "m3-tiny")


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_stream_m3_tiny_tokens(case, tiny):
    """Pieces as the engine decodes them: m3-tiny's tokens (markers are plain text to it, cut anywhere)."""
    stream = TextStream(tiny, SamplingParams(), prompt_ids=tiny.encode("]~b]ai\n", add_special_tokens=False))
    pieces = [stream.push(i)[0] for i in tiny.encode(case["text"], add_special_tokens=False)] + [stream.finish()]
    assert "".join(pieces) == case["text"]
    assert _summary(_streamed(case, pieces)) == _summary(parse_assistant(
        case["text"], case["tools"], starts_in_reasoning=case["starts_in_reasoning"]))


def test_content_never_holds_reasoning_or_partial_markers():
    """While streaming, the content sent so far is always a prefix of the final content (nothing is taken
    back), so a partial marker or reasoning text never goes out as content."""
    for case in CORPUS:
        final = parse_assistant(case["text"], case["tools"], starts_in_reasoning=case["starts_in_reasoning"])
        parser = AssistantStreamParser(case["tools"], starts_in_reasoning=case["starts_in_reasoning"])
        sent = ""
        for ch in case["text"]:
            sent += "".join(d.content or "" for d in parser.feed(ch))
            assert (final.content or "").startswith(sent), (case["id"], sent)


def test_thinking_mode_and_deltas_shape():
    assert parse_assistant("r</mm:think>a", thinking_mode="enabled").reasoning_content == "r"
    assert parse_assistant("r</mm:think>a", thinking_mode="disabled").content == "r</mm:think>a"
    single = next(c for c in CORPUS if c["id"] == "single_call")
    parser = AssistantStreamParser(single["tools"])
    deltas = parser.feed(single["text"]) + parser.finish()
    call = deltas[0].to_dict()["tool_calls"][0]
    assert call["index"] == 0 and call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")
    message = parse_assistant("<mm:think>r</mm:think>a", CORPUS[0]["tools"]).to_dict()
    assert message == {"role": "assistant", "content": "a", "reasoning_content": "r"}


def test_odd_tools_and_schemas_never_raise():
    text = render_tool_call("f", {"a": {"b": [1, "x"]}, "c": "2"})
    odd_tools = [None, "f", {"function": "f"}, {"name": 3}, {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": ["array", "integer"], "items": 5}, "c": {"anyOf": "x"}},
        "additionalProperties": 7}}, {"name": "g", "parameters": {"properties": {"a": 5, "c": {"type": 1}}}}]
    for name in ("f", "g"):
        message = parse_assistant(text.replace('"f"', f'"{name}"'), odd_tools)
        assert message.tool_calls[0].function.name == name and message.content is None
        assert json.loads(message.tool_calls[0].function.arguments) == {"a": {"b": [1, "x"]}, "c": 2}
