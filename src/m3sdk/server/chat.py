"""POST /v1/chat/completions: messages through the checkpoint's chat template, n choices, streamed or whole.

A stream opens each choice with `delta.role`, carries text in `delta.content`, ends each choice with its
finish_reason, and (stream_options.include_usage) sends the usage in a last chunk with no choices.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

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
)
from m3sdk.server.sampling import choose_max_tokens, refuse_structured_fields, sampling_params
from m3sdk.server.sse import STREAMED, EventStream, event

router = APIRouter()


def _logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _prompt_ids(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    messages: list[dict[str, Any]] = [m.model_dump(exclude_none=True) for m in req.messages]
    tokenizer = ctx.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, **(req.chat_template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)


@router.post("/v1/chat/completions", responses=STREAMED, response_model=ChatCompletion)
async def create_chat_completion(req: ChatCompletionRequest,
                                 ctx: Annotated[ServerContext, Depends(context)], http: Request) -> Response:
    model = ctx.check_model(req.model)
    if req.tools and req.tool_choice != "none":
        raise not_supported("tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise not_supported("response_format", f" of type {req.response_format.type!r}")
    refuse_structured_fields(req)
    params = sampling_params(req, max_tokens=choose_max_tokens(req.max_completion_tokens, req.max_tokens),
                             logprobs=_logprobs(req))
    prompt = _prompt_ids(ctx, req)
    rid = new_id("chatcmpl")
    fan = await start(ctx.engine, [(prompt, p) for p in params], rid)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(ctx, fan, rid, model, req.n, usage))
    async with cancelled_on_disconnect(http.receive):
        results = await collect(fan, req.n)
        tokenizer = ctx.engine.tokenizer
        choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(r.text)), finish_reason=r.finish_reason,
                              logprobs=chat_logprobs(tokenizer, r.logprobs) if req.logprobs else None)
                   for i, r in enumerate(results)]
        return ChatCompletion(id=rid, model=model, choices=choices, usage=usage_info([r.usage for r in results], req.n))
    return Response(status_code=499)  # the client left: its requests are aborted, nobody reads this


async def _events(ctx: ServerContext, fan: FanOut, rid: str, model: str, n: int,
                  include_usage: bool) -> AsyncGenerator[bytes, None]:
    tokenizer = ctx.engine.tokenizer
    usages = [None] * n
    try:
        for i in range(n):
            role = ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            yield event(ChatCompletionChunk(id=rid, model=model, choices=[role]))
        async for index, chunk in fan:
            logprobs = chat_logprobs(tokenizer, chunk.logprobs) if chunk.logprobs is not None else None
            if chunk.finish_reason is not None:
                usages[index] = chunk.usage
            choice = ChatChunkChoice(index=index, delta=ChatDelta(content=chunk.text or None), logprobs=logprobs,
                                     finish_reason=chunk.finish_reason)
            yield event(ChatCompletionChunk(id=rid, model=model, choices=[choice]))
    finally:
        fan.close()
    if include_usage:
        yield event(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage_info(usages, n)))
