"""The results of a chat call (`Engine.chat`, `Engine.chat_stream`): the reply parsed into an AssistantMessage, or
its deltas as they stream, with OpenAI's finish reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from m3sdk.chat.messages import AssistantDelta, AssistantMessage
from m3sdk.request import FinishReason, Timings, Usage

if TYPE_CHECKING:
    from m3sdk.sampler import SampledToken

ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]


def chat_finish_reason(reason: FinishReason, called_tools: bool) -> ChatFinishReason:
    """A reply that ended by itself after calling tools ends with "tool_calls"."""
    return "tool_calls" if reason == "stop" and called_tools else reason


@dataclass(frozen=True)
class ChatCompletion:
    request_id: str
    message: AssistantMessage
    finish_reason: ChatFinishReason
    usage: Usage
    timings: Timings
    text: str  # the reply as the model wrote it (markup included)


@dataclass(frozen=True)
class ChatCompletionChunk:
    """One step's deltas of a streamed reply (possibly none: text the parser holds back until it decides what it
    is). The last chunk has `finish_reason`, `usage` and `timings`."""

    request_id: str
    deltas: list[AssistantDelta] = field(default_factory=list)
    finish_reason: ChatFinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    logprobs: list[SampledToken] | None = None  # this step's sampled tokens, when the params ask for logprobs
