"""Outbox: the packed messages of one transfer on their way from the producer (a prefill node's engine thread) to
the transport's push, with the staging buffers they are gathered into (BufferPool) and the thread that waits for
their device work (DeviceWaits). Independent of the wire library: a transport posts what the outbox delivers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from m3sdk.disagg import wire
from m3sdk.disagg.wire import MessageSpec, TransferPlan


class BufferPool:
    """Staging buffers kept for reuse: a fresh buffer pays a page fault per 4 KiB page on first touch, which makes a
    copy into it an order of magnitude slower than into a reused one. Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (a view of a pooled one at most twice as large, or a new one)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare like with like: buffers say cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.device == device and nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._lock:
            self._free.append(base)
            while sum(b.numel() for b in self._free) > self.max_bytes:
                self._free.pop(0)


class DeviceWaits:
    """A thread per transport that waits, in the order they were packed, for the device work that wrote packed
    messages (their pages, or their gather into a staging buffer: UCX reads on its own streams, so a send must not
    start before it is done) and delivers each message (Outbox._deliver: for a plan of pieces it posts the sends
    right there, so a message ready on the device goes out without a hop through the disagg loop)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[torch.cuda.Event, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, ready: torch.cuda.Event, deliver: Callable[[], Any]) -> None:
        """Call `deliver` (from this object's thread) once `ready` completed."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="m3sdk-kv-gathers", daemon=True)
                self._thread.start()
            self._queue.put((ready, deliver))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ready, deliver = item
            ready.synchronize()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for the message any more
                deliver()

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread = None


class InPlace:
    """A message sent from or received into a pool's pages (ucp.py), as the parts of a plan of pieces: its header
    slot, its pieces in payload order, its trailer slot (`frame`: header and trailer, 80 bytes of host memory), as
    (address, bytes, memory type)."""

    __slots__ = ("keep", "parts")

    def __init__(self, frame: torch.Tensor, pieces: list[torch.Tensor]):
        self.keep = (frame, pieces)
        head, memory = frame.data_ptr(), pieces[0].device.type if pieces else "cpu"
        self.parts = [(head, wire.HEADER_BYTES, "cpu"),
                      *((p.data_ptr(), p.numel() * p.element_size(), memory) for p in pieces),
                      (head + wire.HEADER_BYTES, wire.TRAILER_BYTES, "cpu")]


def buffer_parts(buf: torch.Tensor, plan: TransferPlan, msg: MessageSpec) -> list[tuple[int, int, str]]:
    """A staging buffer of message `msg` cut as a plan of pieces moves it: header, each piece, trailer."""
    at, memory = buf.data_ptr(), buf.device.type
    parts = [(at, wire.HEADER_BYTES, memory)]
    at += wire.HEADER_BYTES
    for n in plan.piece_bytes(msg):
        parts.append((at, n, memory))
        at += n
    return [*parts, (at, wire.TRAILER_BYTES, memory)]


class Outbox:
    """The packed messages of one transfer, from the producer (the prefill backend, any thread) to `push`, which
    sends them in plan order as they come. Create it on the disagg loop.

    `in_place`: a message of a plan of pieces whose source pages line up with the decode side's runs (a fresh
    engine's page tables do) is not gathered but sent straight from the pool's pages (ucp.py), so the node's copy
    goes; the producer then keeps those pages unchanged until `released` is set (`reads_pages` says whether it
    must). Otherwise a message is gathered into a staging buffer, sent as one UCX message or, for a plan of pieces,
    cut the same way. `push` sets `released` when it ends, however it ends: every message sent, or the push failed
    or was cancelled (its endpoint dropped when a send in flight did not finish within the transport's
    drain_timeout).

    A plan of pieces' messages are posted by the thread that finds them ready (the producer's, or the transport's
    device-wait thread when their device work had yet to run) once the push runs (`start_sending`), and reach the
    push as posted sends; otherwise, and before the push started, the push posts them."""

    def __init__(self, plan: TransferPlan, device: torch.device, pool: BufferPool, gathers: DeviceWaits,
                 posting: threading.Lock, in_place: bool = False):
        self.plan, self.device, self._pool, self._gathers = plan, torch.device(device), pool, gathers
        self._frames = wire.frames(plan, self.device)
        self._layout: wire.Layout | None = None  # where the messages' pages are in the producer's pool
        self._loop = asyncio.get_running_loop()
        # (index, message, its send: posted by the producer's side (a future), failed to post there (the error), or
        # left to the push (None))
        self._queue: asyncio.Queue[tuple[int, torch.Tensor | InPlace, asyncio.Future | Exception | None]] = \
            asyncio.Queue()
        # the push's poster of a message (from any thread) while the push runs; set and used under the transport's
        # posting lock, which endpoints are dropped under too
        self._sender: Callable[[int, torch.Tensor | InPlace], asyncio.Future] | None = None
        self._posting = posting
        self._in_place = in_place
        self._aligned = False  # the source pages line up with the destination's runs: its pieces are the decode's
        self._host_frames: torch.Tensor | None = None
        self._items: dict[int, InPlace] = {}  # in-place messages' parts, by index (worked out once)
        self.reads_pages = False  # a message was queued in place: its pages must stay until `released`
        self.released = threading.Event()
        self.abandon: Callable[[], None] | None = None  # set by push: drops its endpoint, fails it (on the loop)
        self.sent = 0  # messages the decode side has taken (their sends completed)

    def prepare(self, rows: list[list[torch.Tensor]], src_pages: torch.Tensor) -> None:
        """Work out where every message's pages are in `rows` at `src_pages` now, before the forward that computes
        them (a node knows its source pages when it plans the step): then packing a message during the forward is
        a few calls, and no message's pieces are built between two sends (Python runs slower while UCX moves
        data, and a send would wait for them)."""
        with torch.inference_mode(False):
            layout = self._layout_for(rows, src_pages)
            layout.prepare()
            if self._in_place and self._aligned:  # its parts too: a pack then queues them as they are
                for msg in self.plan.messages:
                    self._in_place_item(msg)

    def _layout_for(self, rows: list[list[torch.Tensor]], src_pages: torch.Tensor) -> wire.Layout:
        if self._layout is None or self._layout.pages is not src_pages or self._layout.rows is not rows:
            # once per transfer; pieces cut where the decode side's are, when the source pages allow it
            runs = self.plan.source_runs(src_pages) if self.plan.pieces else None
            self._layout = wire.Layout(self.plan, rows, src_pages, runs)
            self._aligned = runs is not None
        return self._layout

    def pack(self, messages: list[MessageSpec], rows: list[list[torch.Tensor]], src_pages: torch.Tensor) -> None:
        """Gather `messages` from `rows` at `src_pages` (the transfer's source pages) into staging buffers and
        queue them. The copy is taken now, so the caller may overwrite or free the pages once this returns (on a
        GPU: once the current stream passed this point; `push` waits for it before sending). In place (see the
        class): queued without a copy, and `reads_pages` is set."""
        # the engine calls this from its forward (inference mode): pooled buffers must stay ordinary tensors
        with torch.inference_mode(False):
            self._layout_for(rows, src_pages)
            if self._in_place and self._aligned:  # the pages of all of them are ready at one point of the stream
                self.reads_pages = True
                self._ready([(msg.index, self._in_place_item(msg)) for msg in messages])
                return
            for msg in messages:  # each after its own gather: its send need not wait for the next gather
                buf = self._pool.take(msg.nbytes, self.device)
                wire.pack(self.plan, msg, self._layout, buf, self._frames)
                self._ready([(msg.index, buf)])

    def _in_place_item(self, msg: MessageSpec) -> InPlace:
        item = self._items.get(msg.index)
        if item is None:
            item = self._items[msg.index] = InPlace(self._host_frame_table()[msg.index], self._layout.pool(msg)[0])
        return item

    def _ready(self, batch: list[tuple[int, torch.Tensor | InPlace]]) -> None:
        """Deliver `batch` once the work queued so far on the current stream ran (UCX reads on its own streams):
        now if it already ran (a CPU, or a GPU with nothing of it left to run), else from the transport's device-wait
        thread when it has. The wait is only handed over when there is something to wait for: the hand-over itself
        delays the first post (a node's forward usually runs ahead of its GPU, so both cases occur)."""
        deliver = functools.partial(self._deliver, batch)
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            if not ready.query():
                self._gathers.put(ready, deliver)
                return
        deliver()

    def _deliver(self, batch: list[tuple[int, torch.Tensor | InPlace]]) -> None:
        """From the thread that found the messages of `batch` ready: post their sends now if the push lets this side
        do it, and queue them for the push. Under the posting lock, so that once the push stopped this side's
        posting (`stop_sending`), every send posted here is on its way to the queue."""
        with self._posting:
            for index, item in batch:
                send: asyncio.Future | Exception | None = None
                if self._sender is not None:
                    try:
                        send = self._sender(index, item)
                    except Exception as e:  # the push raises it
                        send = e
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item, send))

    def start_sending(self, sender: Callable[[int, torch.Tensor | InPlace], asyncio.Future]) -> None:
        """From the push (on the loop): `sender` posts a message's sends, from whichever thread finds it ready."""
        with self._posting:
            self._sender = sender

    async def stop_sending(self) -> list[tuple[asyncio.Future, torch.Tensor | InPlace]]:
        """No more posts from the producer's side; returns the sends posted there that the push did not take."""
        with self._posting:
            self._sender = None
        await asyncio.sleep(0)  # the queueing of those posted before (call_soon_threadsafe) runs first
        posted = []
        while not self._queue.empty():
            _, item, send = self._queue.get_nowait()
            if isinstance(send, asyncio.Future):
                posted.append((send, item))
        return posted

    def _host_frame_table(self) -> torch.Tensor:
        """The frames of in-place messages, in host memory (short messages of their own beside CUDA pieces)."""
        if self.device.type == "cpu":
            return self._frames
        if self._host_frames is None:
            self._host_frames = wire.frames(self.plan, "cpu")
        return self._host_frames

    def wait_released(self, timeout: float) -> bool:
        """From the producer's thread (never the loop's), before it frees or overwrites pages it packed in place:
        wait until no send reads them any more. Past `timeout` s the push's endpoint is dropped (other transfers
        to that decode side fail and fall back, as when a drain times out) and the push fails, and this returns
        False. Sends still in flight after seconds were, as a rule, never matched by the decode side (it died or
        gave the transfer up), so UCX was not reading the pages for them (docs/disaggregation.md: Limits)."""
        if not self.reads_pages or self.released.wait(timeout):
            return True
        dropped = threading.Event()

        def drop() -> None:
            try:
                if self.abandon is not None:
                    self.abandon()
            finally:
                dropped.set()

        with contextlib.suppress(RuntimeError):  # the loop closed: nothing sends any more
            self._loop.call_soon_threadsafe(drop)
            dropped.wait(timeout)
        return False

    def count_sent(self, send: asyncio.Future) -> None:
        if not send.cancelled() and send.exception() is None:
            self.sent += 1

    async def get(self) -> tuple[int, torch.Tensor | InPlace, asyncio.Future | Exception | None]:
        """The next packed message whose gather is done, with its send (see `_queue`)."""
        return await self._queue.get()
