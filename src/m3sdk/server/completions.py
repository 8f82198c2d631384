"""POST /v1/completions: text (or token id) prompts, n choices each, streamed or whole."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from m3sdk.server.context import ServerContext, context, new_id
from m3sdk.server.disconnect import cancelled_on_disconnect
from m3sdk.server.errors import bad_request, not_supported
from m3sdk.server.fanout import FanOut
from m3sdk.server.generation import collect, start, usage_info
from m3sdk.server.logprobs import completion_logprobs
from m3sdk.server.protocol import Completion, CompletionChoice, CompletionRequest
from m3sdk.server.sampling import choose_max_tokens, sampling_params, structured_output
from m3sdk.server.sse import STREAMED, ChunkEvents, EventStream

router = APIRouter()


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


@router.post("/v1/completions", responses=STREAMED, response_model=Completion)
async def create_completion(req: CompletionRequest, ctx: Annotated[ServerContext, Depends(context)],
                            http: Request) -> Response:
    model = ctx.check_model(req.model)
    if req.echo:
        raise not_supported("echo")
    if req.suffix is not None:
        raise not_supported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise not_supported("best_of", " (other than n)")
    params = sampling_params(req, max_tokens=choose_max_tokens(req.max_tokens), logprobs=req.logprobs,
                             constraint=structured_output(req))
    prompts = _prompts(req.prompt)
    rid = new_id("cmpl")
    fan = await start(ctx.engine, [(p, sp) for p in prompts for sp in params], rid)
    tokenizer = ctx.engine.tokenizer
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(ctx, fan, rid, model, req.n, len(prompts) * req.n, usage))
    async with cancelled_on_disconnect(http.receive):
        results = await collect(fan, len(prompts) * req.n)
        choices = [CompletionChoice(index=i, text="".join(r.text), finish_reason=r.finish_reason,
                                    logprobs=None if req.logprobs is None
                                    else completion_logprobs(tokenizer, r.logprobs)) for i, r in enumerate(results)]
        return Completion(id=rid, model=model, choices=choices, usage=usage_info([r.usage for r in results], req.n))
    return Response(status_code=499)  # the client left: its requests are aborted, nobody reads this


async def _events(ctx: ServerContext, fan: FanOut, rid: str, model: str, n: int,
                  total: int, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """Every chunk that has arrived at a wake-up, one event per choice with its text joined, in one write."""
    tokenizer = ctx.engine.tokenizer
    events = ChunkEvents(rid, "text_completion", model)
    offsets, usages = [0] * total, [None] * total
    try:
        async for batch in fan.batches():
            choices: dict[int, dict] = {}
            for index, chunk in batch:
                choice = choices.get(index)
                if choice is None:
                    choice = choices[index] = {"index": index, "text": chunk.text}
                else:
                    choice["text"] += chunk.text
                if chunk.logprobs is not None:
                    more = completion_logprobs(tokenizer, chunk.logprobs, offsets[index]).model_dump(exclude_none=True)
                    if "logprobs" in choice:
                        for key, values in more.items():
                            choice["logprobs"][key] += values
                    else:
                        choice["logprobs"] = more
                offsets[index] += len(chunk.text)
                if chunk.finish_reason is not None:
                    usages[index] = chunk.usage
                    choice["finish_reason"] = chunk.finish_reason
            yield events.choices(list(choices.values()))
    finally:
        fan.close()
    if include_usage:
        yield events.usage(usage_info(usages, n))
