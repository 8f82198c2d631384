"""The one asyncio loop of the disaggregation machinery in a process.

UCX (ucxx) binds its progress to the first event loop that uses it, and the engine core that calls into the
client is a plain thread; so every transport, gRPC channel and in-process node of a process lives on this one
loop, in a daemon thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def disagg_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="m3sdk-disagg", daemon=True).start()
            _loop = loop
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Schedule `coro` on the disagg loop from any thread."""
    return asyncio.run_coroutine_threadsafe(coro, disagg_loop())


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the disagg loop and wait for it (never call this from the loop itself)."""
    return submit(coro).result(timeout)
