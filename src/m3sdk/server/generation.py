"""The engine requests behind one API request, and what each choice has produced so far.

`start` validates and queues every (prompt, params) job before the response starts, so that the engine's refusal
(bad input, overload, a dead engine) is an HTTP status rather than an event in a started stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from m3sdk.engine import Engine, Prompt
from m3sdk.params import SamplingParams
from m3sdk.request import Chunk, Usage
from m3sdk.sampler import SampledToken
from m3sdk.server.fanout import FanOut
from m3sdk.server.protocol import PromptTokensDetails, UsageInfo


async def start(engine: Engine, jobs: Sequence[tuple[Prompt, SamplingParams]], request_id: str) -> FanOut:
    """Queue every (prompt, params) job as engine request `{request_id}-{i}`; raises what the engine refuses
    (bad input before anything is queued, overload or a dead engine at admission)."""
    streams = [engine.stream(prompt, params, request_id=f"{request_id}-{i}") for i, (prompt, params) in enumerate(jobs)]
    fan = FanOut(streams)
    await fan.admitted()
    return fan


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


async def collect(fan: FanOut, n: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(n)]
    try:
        async for index, chunk in fan:
            results[index].add(chunk)
    finally:
        fan.close()
    return results


def usage_info(usages: Sequence[Usage | None], choices_per_prompt: int) -> UsageInfo:
    """Completion tokens of every choice; prompt tokens once per prompt (its n choices share it)."""
    done = [(i, u) for i, u in enumerate(usages) if u is not None]
    prompt = sum(u.prompt_tokens for i, u in done if i % choices_per_prompt == 0)
    cached = sum(u.cached_prompt_tokens for i, u in done if i % choices_per_prompt == 0)
    completion = sum(u.completion_tokens for _, u in done)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
