"""POST /v1/chat/completions: messages (and tools) through the checkpoint's chat template, the reply split into
content, reasoning and tool calls (m3sdk.chat), n choices, streamed or whole.

A stream opens each choice with `delta.role`, then carries `delta.content`, `delta.reasoning_content` and
`delta.tool_calls` (a call's index, id and name on its first delta, its arguments' JSON), never the model's
markup; each choice ends with its finish_reason ("tool_calls" when the reply ended after calling tools), and
with stream_options.include_usage a last chunk with no choices carries the usage.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from m3sdk.chat import AssistantDelta, AssistantStreamParser, join_deltas, prompt_opens_reasoning
from m3sdk.server.context import ServerContext, context, new_id
from m3sdk.server.disconnect import cancelled_on_disconnect
from m3sdk.server.errors import bad_request, not_supported
from m3sdk.server.fanout import FanOut
from m3sdk.server.generation import collect, start, usage_info
from m3sdk.server.logprobs import chat_logprobs
from m3sdk.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from m3sdk.server.sampling import choose_max_tokens, sampling_params, structured_output
from m3sdk.server.sse import STREAMED, EventStream, event

router = APIRouter()


@dataclass(frozen=True)
class _Turn:
    """What every choice of one chat request shares: the prompt and how its replies are parsed."""

    prompt: list[int]
    tools: list[dict[str, Any]] | None  # the tools whose calls the replies may hold (None: parse no calls)
    starts_in_reasoning: bool

    def parser(self) -> AssistantStreamParser:
        return AssistantStreamParser(self.tools, starts_in_reasoning=self.starts_in_reasoning)


def _logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools or req.tool_choice == "none":
        return None
    if req.tool_choice not in (None, "auto"):
        raise not_supported("tool_choice", f" {req.tool_choice!r} (constrained tool calls)")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _constraint(req: ChatCompletionRequest, turn: _Turn) -> dict[str, Any] | None:
    fmt = req.response_format
    constraint = structured_output(req)
    if fmt is not None and fmt.type != "text":
        if constraint is not None:
            raise bad_request("give response_format or a structured-output field, not both", "response_format")
        schema = (fmt.json_schema.schema_ if fmt.json_schema is not None else None) or {}
        constraint = {"json": schema if fmt.type == "json_schema" else {"type": "object"}}
    if constraint is not None and turn.starts_in_reasoning:
        raise bad_request("a constrained reply cannot start inside reasoning: use thinking_mode 'disabled' or "
                          "'adaptive'", "response_format")
    return constraint


def _turn(ctx: ServerContext, req: ChatCompletionRequest) -> _Turn:
    tokenizer = ctx.engine.tokenizer
    tools = _tools(req)
    messages = [m.model_dump(exclude_none=True, by_alias=True) for m in req.messages]
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template_kwargs=req.chat_template_kwargs)
    return _Turn(tokenizer.encode(text, add_special_tokens=False), tools, prompt_opens_reasoning(text))


def _finish_reason(reason: str, called_tools: bool) -> str:
    return "tool_calls" if reason == "stop" and called_tools else reason


@router.post("/v1/chat/completions", responses=STREAMED, response_model=ChatCompletion)
async def create_chat_completion(req: ChatCompletionRequest, ctx: Annotated[ServerContext, Depends(context)],
                                 http: Request) -> Response:
    model = ctx.check_model(req.model)
    turn = _turn(ctx, req)
    params = sampling_params(req, max_tokens=choose_max_tokens(req.max_completion_tokens, req.max_tokens),
                             logprobs=_logprobs(req), constraint=_constraint(req, turn))
    rid = new_id("chatcmpl")
    fan = await start(ctx.engine, [(turn.prompt, p) for p in params], rid)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(ctx, fan, turn, rid, model, req.n, usage))
    async with cancelled_on_disconnect(http.receive):
        results = await collect(fan, req.n)
        choices = [_choice(ctx, i, r.text, r.finish_reason, r.logprobs if req.logprobs else None, turn)
                   for i, r in enumerate(results)]
        return ChatCompletion(id=rid, model=model, choices=choices, usage=usage_info([r.usage for r in results], req.n))
    return Response(status_code=499)  # the client left: its requests are aborted, nobody reads this


def _choice(ctx: ServerContext, index: int, text: list[str], reason: str, logprobs: list | None,
            turn: _Turn) -> ChatChoice:
    parser = turn.parser()
    message = join_deltas([d for piece in text for d in parser.feed(piece)] + parser.finish())
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
             for c in message.tool_calls]
    return ChatChoice(index=index, finish_reason=_finish_reason(reason, bool(calls)),
                      message=AssistantMessage(content=message.content, reasoning_content=message.reasoning_content,
                                               tool_calls=calls),
                      logprobs=None if logprobs is None else chat_logprobs(ctx.engine.tokenizer, logprobs))


def _wire_delta(delta: AssistantDelta) -> ChatDelta:
    calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id is not None else None,
                           function=FunctionCallDelta(name=c.name, arguments=c.arguments))
             for c in delta.tool_calls]
    return ChatDelta(content=delta.content, reasoning_content=delta.reasoning_content, tool_calls=calls or None)


def _step_choices(index: int, deltas: Sequence[AssistantDelta], reason: str | None,
                  logprobs: Any) -> list[ChatChunkChoice]:
    """One engine chunk of a choice as stream choices: one per parsed delta; the chunk's logprobs ride on the
    first, its finish_reason on the last (an empty delta carries them when the parser held all text back)."""
    if not deltas and reason is None and logprobs is None:
        return []
    out = [ChatChunkChoice(index=index, delta=_wire_delta(d)) for d in deltas] or [
        ChatChunkChoice(index=index, delta=ChatDelta())]
    out[0].logprobs = logprobs
    out[-1].finish_reason = reason
    return out


async def _events(ctx: ServerContext, fan: FanOut, turn: _Turn, rid: str, model: str, n: int,
                  include_usage: bool) -> AsyncGenerator[bytes, None]:
    tokenizer = ctx.engine.tokenizer
    parsers = [turn.parser() for _ in range(n)]
    called, usages = [False] * n, [None] * n
    try:
        for i in range(n):
            role = ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            yield event(ChatCompletionChunk(id=rid, model=model, choices=[role]))
        async for index, chunk in fan:
            deltas = parsers[index].feed(chunk.text)
            reason = None
            if chunk.finish_reason is not None:
                deltas += parsers[index].finish()
                usages[index] = chunk.usage
            called[index] = called[index] or any(d.tool_calls for d in deltas)
            if chunk.finish_reason is not None:
                reason = _finish_reason(chunk.finish_reason, called[index])
            logprobs = chat_logprobs(tokenizer, chunk.logprobs) if chunk.logprobs is not None else None
            for choice in _step_choices(index, deltas, reason, logprobs):
                yield event(ChatCompletionChunk(id=rid, model=model, choices=[choice]))
    finally:
        fan.close()
    if include_usage:
        yield event(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage_info(usages, n)))
