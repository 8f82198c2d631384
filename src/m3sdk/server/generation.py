"""The engine requests behind one API request, and what each choice has produced so far.

`start` validates and queues every (prompt, params) job and waits for the first chunk, so that an error of the
engine's admission (overload, a dead engine) is still an HTTP status rather than an event in a started stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from m3sdk.engine import Engine, Prompt
from m3sdk.params import SamplingParams
from m3sdk.request import Chunk, Usage
from m3sdk.sampler import SampledToken
from m3sdk.server.fanout import merge
from m3sdk.server.protocol import PromptTokensDetails, UsageInfo

Indexed = tuple[int, Chunk]


async def start(engine: Engine, jobs: Sequence[tuple[Prompt, SamplingParams]],
                request_id: str) -> AsyncGenerator[Indexed, None]:
    """(choice index, chunk) of every job, merged; raises before returning if the first chunk is an error."""
    streams = [engine.stream(prompt, params, request_id=f"{request_id}-{i}") for i, (prompt, params) in enumerate(jobs)]
    merged = merge(streams)
    try:
        first = await anext(merged)
    except BaseException:
        await merged.aclose()
        raise
    return _prepend(first, merged)


async def _prepend(first: Indexed, rest: AsyncGenerator[Indexed, None]) -> AsyncGenerator[Indexed, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


@dataclass
class ChoiceResult:
    """One choice's text, logprobs and end, gathered from its chunks."""

    text: list[str] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        if chunk.logprobs:
            self.logprobs += chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage


async def collect(chunks: AsyncGenerator[Indexed, None], n: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(n)]
    try:
        async for index, chunk in chunks:
            results[index].add(chunk)
    finally:
        await chunks.aclose()
    return results


def usage_info(usages: Sequence[Usage | None], choices_per_prompt: int) -> UsageInfo:
    """Completion tokens of every choice; prompt tokens once per prompt (its n choices share it)."""
    done = [(i, u) for i, u in enumerate(usages) if u is not None]
    prompt = sum(u.prompt_tokens for i, u in done if i % choices_per_prompt == 0)
    cached = sum(u.cached_prompt_tokens for i, u in done if i % choices_per_prompt == 0)
    completion = sum(u.completion_tokens for _, u in done)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
