"""m3-tiny served by the engine, its prompt rendered with tools and a thinking mode: the streamed chunks, fed to
AssistantStreamParser as they arrive, add up to parse_assistant of the finished text."""

from pathlib import Path

import pytest

import m3sdk
from m3sdk import Engine
from m3sdk.chat import AssistantStreamParser, join_deltas, parse_assistant, prompt_opens_reasoning
from m3sdk.tokenizer import Tokenizer

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}


@pytest.mark.parametrize("mode", ["enabled", "adaptive"])
async def test_engine_chunks_parse_like_the_whole_text(mode):
    tokenizer = Tokenizer.from_pretrained(Path(m3sdk.__file__).parent / "assets" / "m3-tiny")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me of Mr. Darcy."}], tools=[SEARCH],
                                           chat_template_kwargs={"thinking_mode": mode})
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    reasoning = prompt_opens_reasoning(prompt)
    assert reasoning == (mode == "enabled")
    async with Engine(device="cpu", max_model_len=1024, max_num_seqs=4) as engine:
        for seed in range(3):
            parser = AssistantStreamParser([SEARCH], starts_in_reasoning=reasoning)
            deltas, text = [], ""
            async for chunk in engine.stream(ids, max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True):
                deltas += parser.feed(chunk.text)
                text += chunk.text
            deltas += parser.finish()
            whole = parse_assistant(text, [SEARCH], thinking_mode=mode)
            assert join_deltas(deltas).content == whole.content
            assert join_deltas(deltas).reasoning_content == whole.reasoning_content
            if mode == "enabled" and "</mm:think>" not in text:  # all of it is reasoning
                assert whole.content is None and whole.reasoning_content == text.strip()
