"""The engine streams behind one API request (its n choices, or its prompts x n), read as one stream of
(choice index, chunk) in arrival order.

Every stream is pumped by a task of its own from the start, so `admitted()` can tell, one loop turn later,
whether the engine took them all: the Engine admits a stream (or raises EngineOverloadedError, EngineDeadError)
as its iteration starts, before it waits for any chunk. Admission errors are thus HTTP statuses, while a stream
waiting in the engine's queue already has its response open (and its client's disconnect noticed). Closing the
fan-out, or an error in any stream, cancels the others, which aborts their engine requests.
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
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

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
        await asyncio.sleep(0)  # the pumps, created before this turn, start their streams first
        if self._refusals:
            self.close()
            raise self._refusals[0]

    async def __aiter__(self) -> AsyncIterator[tuple[int, T]]:
        try:
            while self._live:
                index, item = await self._queue.get()
                if item is _END:
                    self._live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every stream still running; a cancelled pump closes its engine stream, aborting the request,
        when it next runs (no await here, so closing works from a cancelled scope)."""
        self._live = 0
        for task in self._tasks:
            task.cancel()
