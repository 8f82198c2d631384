"""Several engine streams (the n choices of one API request) read as one: (choice index, chunk) in arrival order.

Closing the merged stream, or an error in any choice, cancels every choice still running, which aborts its
engine request (the engine aborts a request whose stream is left early)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    if len(streams) == 1:  # the common case: no task, no queue
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        # no await here: a cancelled pump closes its engine stream (which aborts the request) when it next runs
        for task in tasks:
            task.cancel()
