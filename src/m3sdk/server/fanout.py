"""The engine streams behind one API request (its n choices, or its prompts x n), read as batches of
(choice index, chunk): whatever has arrived when the reader wakes, in arrival order.

Admission: the Engine admits a stream (or raises EngineOverloadedError, EngineDeadError) as its iteration starts,
before it waits for any chunk. Every stream's iteration is started by a task of its own at once, so `admitted()`
can tell, one loop turn later, whether the engine took them all: admission errors are thus HTTP statuses, while a
stream waiting in the engine's queue already has its response open (and its client's disconnect noticed).

One stream (the common request) is read in place after its first chunk: the reader's task waits on the engine's
channel itself, one wake-up per engine step, with no pump task and queue between (the engine already merges the
steps that waited into one chunk). Several streams are pumped by a task each into one queue, which the reader
drains at each wake-up. Closing the fan-out, or an error in any stream, cancels the others, which aborts their
engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Generic, TypeVar

_END = object()

T = TypeVar("T")  # an engine stream's item: a Chunk, or a chat step


class FanOut(Generic[T]):
    def __init__(self, streams: Sequence[AsyncIterator[T]]):
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._live = len(streams)
        self._refusals: list[Exception] = []
        # the one stream read in place; its first chunk comes from a task, which starts (admits) it now
        self._single = streams[0] if len(streams) == 1 else None
        self._closing: asyncio.Task | None = None  # closes a single stream that waits at a yield
        if self._single is not None:
            self._tasks = [asyncio.create_task(self._first(self._single))]
        else:
            self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _first(self, stream: AsyncIterator[T]) -> T | object:
        try:
            return await anext(stream, _END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._refusals.append(exc)
            return exc

    async def _pump(self, index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream) as chunks:
                async for chunk in chunks:
                    self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._refusals.append(exc)
            self._queue.put_nowait((index, exc))

    async def admitted(self) -> None:
        """Raise the engine's refusal of any stream (the fan-out is closed then)."""
        await asyncio.sleep(0)  # the tasks, created before this turn, start their streams first
        if self._refusals:
            self.close()
            raise self._refusals[0]

    async def __aiter__(self) -> AsyncIterator[tuple[int, T]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[tuple[int, T]]]:
        """Every (index, chunk) that has arrived, as one list per wake-up."""
        try:
            if self._single is not None:
                first = await self._tasks[0]
                if first is _END:
                    return
                if isinstance(first, Exception):
                    raise first
                yield [(0, first)]
                async for chunk in self._single:
                    yield [(0, chunk)]
                return
            while self._live:
                batch = []
                index, item = await self._queue.get()
                while True:
                    if item is _END:
                        self._live -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        batch.append((index, item))
                    if self._queue.empty():
                        break
                    index, item = self._queue.get_nowait()
                if batch:
                    yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every stream still running, which closes its engine stream and aborts the request when its task
        next runs (no await here, so closing works from a cancelled scope)."""
        self._live = 0
        if self._single is not None and self._tasks[0].done() and self._closing is None:
            # read in place: it waits at a yield (or has ended), so a task of its own closes it
            self._closing = asyncio.get_running_loop().create_task(self._single.aclose())
        for task in self._tasks:
            task.cancel()
