"""Server-sent events as OpenAI streams them: `data: {json}` events, then `data: [DONE]`.

Written here rather than taken from sse-starlette: OpenAI's stream uses no event names, ids, retries or pings, so
the whole format is two lines, and what matters is the disconnect. EventStream always listens for the client
leaving (whatever ASGI spec version the server speaks) and then cancels the producer and closes its iterator at
once, so the engine aborts the request and frees its pages rather than generating for nobody.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import anyio
import orjson
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from m3sdk.server.disconnect import cancelled_on_disconnect
from m3sdk.server.errors import to_api_error

DONE = b"data: [DONE]\n\n"
# the OpenAPI note of a route that streams when asked: its 200 is JSON, or these events with `stream: true`
STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events when streaming"}}


def event(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=True).encode()
    else:
        data = orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


class ChunkEvents:
    """The events of one stream's chunks. What every chunk of a stream shares (id, object, created, model) is
    encoded once; each event then encodes only its choices, plain dicts in the wire shape (None fields left out,
    as `event` leaves them out of a model), with orjson: a pydantic model per token costs the event loop more
    than the token's whole journey from the engine."""

    def __init__(self, request_id: str, object_name: str, model: str):
        head = orjson.dumps({"id": request_id, "object": object_name, "created": int(time.time()), "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":['

    def choices(self, choices: Sequence[dict[str, Any]]) -> bytes:
        """One event per choice (clients expect one choice per chunk), framed together for one write."""
        return b"".join(self._head + orjson.dumps(c) + b"]}\n\n" for c in choices)

    def usage(self, usage: BaseModel) -> bytes:
        """The last event with stream_options.include_usage: no choices, the request's usage."""
        return self._head + b'],"usage":' + usage.model_dump_json(exclude_none=True).encode() + b"}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response of already-framed events. An exception inside the stream (the headers are
    out by then) becomes one error event; [DONE] ends every stream that was not cut by the client."""

    def __init__(self, events: AsyncGenerator[bytes, None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with cancelled_on_disconnect(receive):
            await self._send_all(send)

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for data in self._events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except Exception as exc:  # noqa: BLE001 - the status is sent: the client learns of it in the stream
            await send({"type": "http.response.body", "body": event(to_api_error(exc).body()), "more_body": True})
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled client still gets its request aborted
                await self._events.aclose()
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
