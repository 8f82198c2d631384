"""POST /v1/chat/completions over Engine.chat_stream: messages and tools through the checkpoint's chat template,
the reply split into content, reasoning and tool calls by the engine, n choices, streamed or whole. User messages
may hold image parts (server/media.py says which images a client may name).

A stream opens each choice with `delta.role`, then carries `delta.content`, `delta.reasoning_content` and
`delta.tool_calls` (a call's index, id and name on its first delta, then its arguments' JSON), never the model's
markup; each choice ends with its finish_reason ("tool_calls" when the reply ended after calling tools), and
with stream_options.include_usage a last chunk with no choices carries the usage.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from m3sdk.chat import AssistantDelta, join_deltas
from m3sdk.chat.completion import ChatCompletionChunk as EngineChunk
from m3sdk.chat.image_parts import is_image_part
from m3sdk.params import SamplingParams
from m3sdk.server.context import ServerContext, context, new_id
from m3sdk.server.disconnect import cancelled_on_disconnect
from m3sdk.server.errors import bad_request
from m3sdk.server.fanout import FanOut
from m3sdk.server.generation import usage_info
from m3sdk.server.logprobs import chat_logprobs
from m3sdk.server.media import checked_media
from m3sdk.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
)
from m3sdk.server.sampling import choose_max_tokens, sampling_params, structured_output
from m3sdk.server.sse import STREAMED, ChunkEvents, EventStream

router = APIRouter()


def _logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _streams(ctx: ServerContext, req: ChatCompletionRequest, params: Sequence[SamplingParams],
             rid: str) -> list[AsyncIterator[EngineChunk]]:
    """One engine chat stream per choice, validated here (InvalidRequestError before anything is queued)."""
    messages = checked_media([m.model_dump(exclude_none=True, by_alias=True) for m in req.messages],
                             ctx.allowed_local_media_path)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    response_format = req.response_format.model_dump(exclude_none=True, by_alias=True) if req.response_format else None
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
    return [ctx.engine.chat_stream(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                   chat_template_kwargs=req.chat_template_kwargs, parallel_tool_calls=parallel,
                                   params=p, request_id=f"{rid}-{i}") for i, p in enumerate(params)]


@router.post("/v1/chat/completions", responses=STREAMED, response_model=ChatCompletion)
async def create_chat_completion(req: ChatCompletionRequest, ctx: Annotated[ServerContext, Depends(context)],
                                 http: Request) -> Response:
    model = ctx.check_model(req.model)
    params = sampling_params(req, max_tokens=choose_max_tokens(req.max_completion_tokens, req.max_tokens),
                             logprobs=_logprobs(req), constraint=structured_output(req))
    rid = new_id("chatcmpl")
    images = any(isinstance(m.content, list) and any(map(is_image_part, m.content)) for m in req.messages)
    # images are decoded and resized as the streams are made: in a worker thread, not on the serving loop
    streams = await anyio.to_thread.run_sync(_streams, ctx, req, params, rid) if images else _streams(
        ctx, req, params, rid)
    fan = FanOut(streams)
    await fan.admitted()
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(ctx, fan, rid, model, req.n, usage))
    async with cancelled_on_disconnect(http.receive):
        return await _whole(ctx, fan, rid, model, req.n, req.logprobs)
    return Response(status_code=499)  # the client left: its requests are aborted, nobody reads this


async def _whole(ctx: ServerContext, fan: FanOut, rid: str, model: str, n: int, want_logprobs: bool) -> ChatCompletion:
    deltas: list[list[AssistantDelta]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    last: list[EngineChunk | None] = [None] * n
    try:
        async for index, chunk in fan:
            deltas[index] += chunk.deltas
            logprobs[index] += chunk.logprobs or []
            last[index] = chunk
    finally:
        fan.close()
    choices = []
    for i, chunk in enumerate(last):
        message = join_deltas(deltas[i])
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
                 for c in message.tool_calls]
        choices.append(ChatChoice(
            index=i, finish_reason=chunk.finish_reason,
            message=AssistantMessage(content=message.content, reasoning_content=message.reasoning_content,
                                     tool_calls=calls),
            logprobs=chat_logprobs(ctx.engine.tokenizer, logprobs[i]) if want_logprobs else None))
    return ChatCompletion(id=rid, model=model, choices=choices, usage=usage_info([c.usage for c in last], n))


def _step_choices(index: int, chunk: EngineChunk, logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One engine step of a choice as stream choices: one per parsed delta; the step's logprobs ride on the first,
    its finish_reason on the last (an empty delta carries them when the parser held all text back)."""
    if not chunk.deltas and chunk.finish_reason is None and logprobs is None:
        return []
    out = [{"index": index, "delta": d.to_dict()} for d in chunk.deltas] or [{"index": index, "delta": {}}]
    if logprobs is not None:
        out[0]["logprobs"] = logprobs
    if chunk.finish_reason is not None:
        out[-1]["finish_reason"] = chunk.finish_reason
    return out


async def _events(ctx: ServerContext, fan: FanOut, rid: str, model: str, n: int,
                  include_usage: bool) -> AsyncGenerator[bytes, None]:
    """Every step that has arrived at a wake-up, as its events in one write."""
    tokenizer = ctx.engine.tokenizer
    events = ChunkEvents(rid, "chat.completion.chunk", model)
    usages: list[Any] = [None] * n
    try:
        yield events.choices([{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(n)])
        async for batch in fan.batches():
            choices = []
            for index, chunk in batch:
                if chunk.finish_reason is not None:
                    usages[index] = chunk.usage
                logprobs = None
                if chunk.logprobs is not None:
                    logprobs = chat_logprobs(tokenizer, chunk.logprobs).model_dump(exclude_none=True)
                choices += _step_choices(index, chunk, logprobs)
            if choices:
                yield events.choices(choices)
    finally:
        fan.close()
    if include_usage:
        yield events.usage(usage_info(usages, n))
