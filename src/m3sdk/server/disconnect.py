"""Noticing a client that left. ASGI servers tell an app only through `receive()` (an http.disconnect message),
and do not cancel the handler, so a response that takes time must listen itself; cancelling its work closes the
engine streams behind it, which aborts their requests and frees their pages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from starlette.types import Receive


async def until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@asynccontextmanager
async def cancelled_on_disconnect(receive: Receive) -> AsyncIterator[anyio.CancelScope]:
    """Run the body until it ends or the client leaves; then `scope.cancel_called` tells which. The body's own
    exceptions pass through as they are (no exception group), for the error handlers to map."""
    scope = anyio.CancelScope()

    async def watch() -> None:
        await until_disconnected(receive)
        scope.cancel()

    watcher = asyncio.create_task(watch())
    try:
        with scope:
            yield scope
    finally:
        watcher.cancel()
