"""The KV transport seam and its UCX implementation (ucxx).

The decode side posts receive buffers for a transfer's messages (`receive`); the prefill side packs pages into
messages as they are computed and queues them in an `Outbox` (from any thread), which `push` sends in order;
the decode side checks each message against the plan before it scatters the pages into its pool (wire.py).
ucxx offers two-sided tag messaging (no one-sided RMA from Python), so "posted buffers + scatter" is the shape of
the protocol. A decode side whose pages form runs (`in_place`, the default) asks for plans of pieces: each message
travels as one UCX message per part (header, each (layer, tensor, run) piece, trailer; ucp.py, ctypes on libucp)
straight from the node's pages into its own, so neither side copies; the node keeps its pages until the sends let
go of them (Outbox.wait_released), the decode side checks header and trailer once the message arrived and zeroes
a failed transfer's pages (UcxReceive.cancel).

Connection direction: the decode side listens; a prefill node connects to the port the decode side declared,
on the address its gRPC call came from. So a node never parses a peer-supplied UCX address (a malformed one
can abort the process inside UCX), and the decode side accepts nothing but messages whose 64-bit tags it
posted, whose headers and trailers it checks.

Endpoints are created without UCX peer error handling. With it, this UCX (1.21) keeps shared memory out of an
endpoint's lanes and moves every byte over TCP even between processes of one host (UCX_LOG_LEVEL=info:
"tag(tcp/lo)"; without it: "tag(sysv/memory cma/memory)"; docs/perf.md has the rates). A dead peer is still
noticed: a refused connection or a peer gone mid-message fails the request (UCXXNotConnectedError,
UCXXConnectionResetError: measured), and what UCX cannot see (a peer that dies with nothing in flight) the
deadlines and gRPC heartbeats of client.py and server.py catch. ucxx's create_listener/create_endpoint always
enable error handling, so the binding layer (`ucxx._lib.libucxx`) is used directly here.

CUDA buffers: UCX must see them as CUDA memory (then cuda_ipc / cuda_copy move them). Its memory type cache,
filled by CUDA allocation hooks (libucm_cuda), answers "host" for any allocation it saw no hook for; a CUDA
buffer taken for host memory is copied by the CPU: the sender dies of SIGSEGV and the receiver waits forever
(window 1: the pruned libucx wheel had lost the libcudart that libucm_cuda loads). ucxx turns the cache off
(UCX_MEMTYPE_CACHE=n), but only after its import loaded libucs, which reads its global options when it loads:
too late. So this module sets it before anything imports ucxx, and UCX asks the CUDA driver about each buffer
(about a microsecond a message); `start` refuses to run on a GPU when UCX has no CUDA transport.

Every coroutine here runs on the disagg loop (loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from m3sdk.disagg import ucp, wire
from m3sdk.disagg.wire import MessageSpec, TransferPlan
from m3sdk.observability import get_logger

log = get_logger("m3sdk.disagg.transport")

# before libucs loads (module docstring): a UCX global option, read once when the library is loaded
os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
# completions reach asyncio through ucxx's notifier thread (one wake-up of the loop per batch of finished requests)
# rather than each outstanding request's coroutine polling with asyncio.sleep(0) (ucxx's default, `wait_yield`),
# which turns every loop pass into a sweep over all of them: raw ucxx on this CPU's loopback 3.6-4.2 -> 7.8-8.4
# GB/s in paired runs (docs/disaggregation.md). Read by ucxx.init; the notifier thread is started from the disagg
# loop's (daemon) thread, so it never holds a process at exit
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")


class TransportError(RuntimeError):
    """The transport could not move a transfer (peer gone, connection refused, message refused)."""


class BufferPool:
    """Staging buffers kept for reuse: a fresh buffer pays a page fault per 4 KiB page on first touch (a copy into
    a fresh 64 MiB buffer ran at about 1 GB/s here, into a reused one at about 20 GB/s). Thread-safe."""

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


class _Gathers:
    """A thread per transport that waits, in the order they were packed, for the device work that wrote packed
    messages (their pages, or their gather into a staging buffer: UCX reads on its own streams, so a send must not
    start before it is done) and delivers each message (Outbox._deliver: for a plan of pieces it posts the sends
    right there). Until session 16 this thread handed each message to the loop, whose push posted it: on two H200s
    the first send of a 2 GiB transfer left 0.7-1.0 ms after the clock, through the producer's thread, this one and
    the loop (docs/perf.md)."""

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


class _InPlace:
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


def _buffer_parts(buf: torch.Tensor, plan: TransferPlan, msg: MessageSpec) -> list[tuple[int, int, str]]:
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

    def __init__(self, plan: TransferPlan, device: torch.device, pool: BufferPool, gathers: _Gathers,
                 posting: threading.Lock, in_place: bool = False):
        self.plan, self.device, self._pool, self._gathers = plan, torch.device(device), pool, gathers
        self._frames = wire.frames(plan, self.device)
        self._layout: wire.Layout | None = None  # where the messages' pages are in the producer's pool
        self._loop = asyncio.get_running_loop()
        # (index, message, its send: posted by the producer's side (a future), failed to post there (the error), or
        # left to the push (None))
        self._queue: asyncio.Queue[tuple[int, torch.Tensor | _InPlace, asyncio.Future | Exception | None]] = \
            asyncio.Queue()
        # the push's poster of a message (from any thread) while the push runs; set and used under the transport's
        # posting lock, which endpoints are dropped under too
        self._sender: Callable[[int, torch.Tensor | _InPlace], asyncio.Future] | None = None
        self._posting = posting
        self._in_place = in_place
        self._aligned = False  # the source pages line up with the destination's runs: its pieces are the decode's
        self._host_frames: torch.Tensor | None = None
        self._items: dict[int, _InPlace] = {}  # in-place messages' parts, by index (worked out once)
        self.reads_pages = False  # a message was queued in place: its pages must stay until `released`
        self.released = threading.Event()
        self.abandon: Callable[[], None] | None = None  # set by push: drops its endpoint, fails it (on the loop)
        self.sent = 0  # messages the decode side has taken (their sends completed)

    def prepare(self, rows: list[list[torch.Tensor]], src_pages: torch.Tensor) -> None:
        """Work out where every message's pages are in `rows` at `src_pages` now, before the forward that computes
        them (a node knows its source pages when it plans the step): then packing a message during the forward is
        a few calls. On the H200 pair Python ran several times slower while UCX moved data, and building eight
        messages' pieces between two packs held the second send 1-2.7 ms (session 13 window 3)."""
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

    def _in_place_item(self, msg: MessageSpec) -> _InPlace:
        item = self._items.get(msg.index)
        if item is None:
            item = self._items[msg.index] = _InPlace(self._host_frame_table()[msg.index], self._layout.pool(msg)[0])
        return item

    def _ready(self, batch: list[tuple[int, torch.Tensor | _InPlace]]) -> None:
        """Deliver `batch` once the work queued so far on the current stream ran (UCX reads on its own streams):
        now if it already ran (a CPU, or a GPU with nothing of it left to run), else from the transport's device-wait
        thread when it has. Handing the wait over cost 0.4-0.5 ms before the first post on the H200 pair when there
        was nothing to wait for (session 16 window 3); a node's forward usually runs ahead of its GPU."""
        deliver = functools.partial(self._deliver, batch)
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            if not ready.query():
                self._gathers.put(ready, deliver)
                return
        deliver()

    def _deliver(self, batch: list[tuple[int, torch.Tensor | _InPlace]]) -> None:
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

    def start_sending(self, sender: Callable[[int, torch.Tensor | _InPlace], asyncio.Future]) -> None:
        """From the push (on the loop): `sender` posts a message's sends, from whichever thread finds it ready."""
        with self._posting:
            self._sender = sender

    async def stop_sending(self) -> list[tuple[asyncio.Future, torch.Tensor | _InPlace]]:
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

    async def get(self) -> tuple[int, torch.Tensor | _InPlace, asyncio.Future | Exception | None]:
        """The next packed message whose gather is done, with its send (see `_queue`)."""
        return await self._queue.get()


class Receive(Protocol):
    async def wait(self) -> None:
        """Return once every message arrived, was checked and scattered; raise TransportError otherwise."""

    async def cancel(self) -> None:
        """Retire the posted buffers; once this returns no page of the transfer is written any more. Returns
        within the transport's drain_timeout: a receive UCX still holds then (its peer died mid-message, so no
        bytes are coming) is logged and left to UCX."""


class KVTransport(Protocol):
    name: str
    in_place: bool  # the decode side asks for plans of pieces, and a node may send from its pages (UcxTransport)

    async def start(self, listen: bool) -> None:
        """Initialize; `listen` (decode side) opens the port prefill nodes push to."""

    @property
    def port(self) -> int: ...

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> Receive:
        """Post buffers for `plan` and scatter each checked message into `rows` at `dst_pages`."""

    def outbox(self, plan: TransferPlan, device: torch.device, in_place: bool = False) -> Outbox:
        """Where a producer queues the packed messages of `plan` (call on the disagg loop); `in_place`: the
        producer keeps the pages unchanged until the outbox's `released` (see Outbox), so they may be sent without
        a copy."""

    async def push(self, host: str, port: int, outbox: Outbox) -> None:
        """Send every message of `outbox.plan`, in order as they are queued, to the decode side at host:port."""

    async def close(self) -> None: ...


class _CudaBytes:
    """A CUDA tensor's bytes as ucxx takes them (`__cuda_array_interface__`), without torch's Python property
    (a dozen Python steps per message on each side)."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # kept alive while UCX uses its memory
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel() * t.element_size(),),
                                         "typestr": "|u1", "strides": None, "version": 2}


def _ucx_buffer(t: torch.Tensor) -> Any:
    # ucxx takes the buffer protocol (numpy for host memory) or __cuda_array_interface__ (CUDA tensors)
    if t.is_cuda:
        if not t.is_contiguous():
            raise ValueError("UCX moves contiguous buffers only")
        return _CudaBytes(t)
    return t.numpy()


def _api() -> Any:
    from ucxx._lib import libucxx

    return libucxx


def _worker() -> Any:
    import ucxx

    return ucxx.core._get_ctx().worker


def _using(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _held(req: Any, buf: Any) -> asyncio.Future:
    """`req`'s asyncio future (set by ucxx's notifier; an exception on UCX errors), holding the request and its
    buffer until it completes, whoever else lets go of them (a receive left to UCX after a cancel may still be
    written). The future itself, not a coroutine awaiting it in a task of its own: a completion reaches the code
    that waits for it a loop pass earlier, at no task's cost."""
    fut = req.future
    fut.add_done_callback(lambda _, held=(req, buf): None)
    return fut


def _start_send(ep: Any, buf: Any, tag: int) -> asyncio.Future:
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    return _held(ep.tag_send(Array(buf), Tag(tag)), buf)


def _start_recv(buf: Any, tag: int) -> asyncio.Future:
    """Post a tag receive on the worker (what `ucxx.recv` does, without formatting its debug line every call)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    return _held(_worker().tag_recv(Array(buf), Tag(tag)), buf)


async def _send(ep: Any, buf: Any, tag: int) -> None:
    await _start_send(ep, buf, tag)


class UcxReceive:
    """One transfer's receiving side: `window` messages posted at once, each checked then scattered.

    On GPUs two streams of the transfer's own: arming and checks (a zeroed trailer slot, a header and trailer
    copied to the host: the only host wait, so it sees nothing of the engine's queued steps) on one, the
    scatters on the other, queued without a host wait, so the next message's check and post do not wait for
    them. The scatters start after the work the engine queued before the transfer (its pages were freed before:
    a step in flight then may still write them). A buffer goes back to the pool once its scatter ran; the
    transfer counts as done (and a cancel returns) only after every scatter ran. Where each message goes in the
    pool is worked out once, before the first post (wire.Layout), and per message the loop makes a few calls:
    host time per message paced the GPU transfer (session 12)."""

    def __init__(self, transport: UcxTransport, plan: TransferPlan, rows: list[list[torch.Tensor]],
                 dst_pages: torch.Tensor, window: int):
        self._transport, self._plan, self._dst = transport, plan, dst_pages
        self._layout = wire.Layout(plan, rows, dst_pages, plan.runs)
        # a plan of pieces (what an in-place decode side asks for): each message straight into the pages (ucp.py),
        # nothing staged, so every message is posted at once; otherwise `window` staging buffers
        self._in_place = plan.pieces
        self._window = len(plan.messages) if self._in_place else window
        # in place: each message's header and trailer slots (its first and last parts), zeroed (armed), on the host
        self._slots = torch.zeros(len(plan.messages) if self._in_place else 0,
                                  wire.HEADER_BYTES + wire.TRAILER_BYTES, dtype=torch.uint8)
        # tag -> (buffer, its receive, the message): everything posted and not yet taken
        self._posted: dict[int, tuple[torch.Tensor, asyncio.Future, MessageSpec]] = {}
        cuda = dst_pages.is_cuda
        self._io = torch.cuda.Stream(dst_pages.device) if cuda else None
        self._copy = torch.cuda.Stream(dst_pages.device) if cuda else None
        if cuda:
            self._copy.wait_stream(torch.cuda.current_stream(dst_pages.device))
            # in place, UCX writes the pages on its own streams: the work queued on them before goes first
            self._before = torch.cuda.Event()
            self._before.record(torch.cuda.current_stream(dst_pages.device))
        self._scattering: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # queued on self._copy
        self._cancelled = False
        self._task = asyncio.ensure_future(self._run())

    def _arm(self, index: int) -> torch.Tensor:
        """A buffer for message `index`, its trailer slot zeroed (call on the io stream: a GPU's zeroing must have
        run before the buffer is posted, since UCX writes on streams of its own); in place, its header and
        trailer slots."""
        if self._in_place:
            return self._slots[index]
        buf = self._transport.pool.take(self._plan.messages[index].nbytes, self._dst.device)
        wire.arm(buf)
        return buf

    def _post(self, index: int, buf: torch.Tensor) -> None:
        tag = self._plan.tag(index)
        msg = self._plan.messages[index]
        if self._in_place:
            item = _InPlace(buf, self._layout.pool(msg)[0])
            self._posted[tag] = (buf, ucp.recv(_worker().handle, item.parts, tag, keep=item), msg)
        else:
            self._posted[tag] = (buf, _start_recv(_ucx_buffer(buf), tag), msg)

    async def _take(self, index: int) -> torch.Tensor:
        tag = self._plan.tag(index)
        buf, fut, _ = self._posted[tag]
        try:
            # shielded: a receive UCX still holds must stay visible to cancel(), which retires it
            await asyncio.shield(fut)
        except Exception as e:  # truncation (a message larger than posted), endpoint errors
            raise TransportError(f"transfer {self._plan.transfer_id} message {index}: {e!r}") from e
        if not self._cancelled:
            del self._posted[tag]
        return buf

    def _arrived(self, index: int) -> bool:
        entry = self._posted.get(self._plan.tag(index))
        return entry is not None and entry[1].done()

    def _check(self, msgs: list[MessageSpec], bufs: list[torch.Tensor]) -> None:
        try:
            wire.check(self._plan, msgs, bufs)  # on the io stream: its host wait covers the arming before it too
        except wire.WireError as e:
            raise TransportError(str(e)) from e

    def _place(self, msgs: list[MessageSpec], bufs: list[torch.Tensor]) -> None:
        if self._in_place:  # there already
            return
        wire.place(msgs, self._layout, bufs, self._copy)
        if self._copy is None:  # a CPU scatter is done when it returns
            for buf in bufs:
                self._transport.pool.give(buf)
            return
        done = torch.cuda.Event()
        done.record(self._copy)
        self._scattering.extend((done, buf) for buf in bufs)

    def _release(self, wait: bool) -> None:
        """Buffers whose scatter ran go back to the pool; `wait`: all of them, waiting for their scatters."""
        while self._scattering and (wait or self._scattering[0][0].query()):
            done, buf = self._scattering.popleft()
            done.synchronize()
            self._transport.pool.give(buf)

    async def _run(self) -> None:
        plan = self._plan
        count = len(plan.messages)
        self._layout.prepare()
        # in place, arming and checks touch host slots only: no stream switch (CUDA calls that on the H200 pair
        # contend with UCX's spinning progress thread)
        io = None if self._in_place else self._io
        with _using(io):
            first = [self._arm(index) for index in range(min(self._window, count))]
        if io is not None:
            io.synchronize()
        elif self._dst.is_cuda:
            self._before.synchronize()
        for index, buf in enumerate(first):
            self._post(index, buf)
        index = 0
        while index < count:
            # the next message and every one after it that arrived meanwhile (completions come in bunches when the
            # host falls behind the link): checked under one host wait, placed by one copy
            bufs = [await self._take(index)]
            while index + len(bufs) < count and self._arrived(index + len(bufs)):
                bufs.append(await self._take(index + len(bufs)))  # done: returns at once
            if self._cancelled:
                return
            msgs = list(plan.messages[index:index + len(bufs)])
            self._release(wait=False)
            following = range(index + self._window, min(index + len(bufs) + self._window, count))
            with _using(io):
                armed = [self._arm(i) for i in following]
                self._check(msgs, bufs)
            for i, buf in zip(following, armed, strict=True):  # before the scatter, so UCX can fill them meanwhile
                self._post(i, buf)
            self._place(msgs, bufs)
            index += len(bufs)
        self._release(wait=True)  # the pages are in place before the transfer counts as done

    async def wait(self) -> None:
        try:
            await asyncio.shield(self._task)
        except TransportError:
            await self.cancel()
            raise

    async def cancel(self) -> None:
        self._cancelled = True
        open_ = {tag: entry for tag, entry in self._posted.items() if not entry[1].done()}
        cancels = {}
        for tag, (_, fut, msg) in open_.items():
            if self._in_place:  # ucp's own receives: those no message matched yet are taken back at once
                ucp.cancel(fut)
                continue
            cancels[tag] = wire.cancel_message(self._plan, msg)
            await self._transport.send_to_self(cancels[tag], tag)
        # bounded: without peer error handling UCX never fails a receive whose sender died mid-message
        _, stuck = await asyncio.wait([fut for _, fut, _ in open_.values()], timeout=self._transport.drain_timeout) \
            if open_ else (set(), set())
        for tag, (buf, fut, _) in open_.items():
            if fut in stuck:
                continue
            if not fut.cancelled():
                fut.exception()  # retrieved: a failed receive is what cancel() expects
            if tag in cancels and bytes(buf[:len(cancels[tag])].cpu().numpy()) != cancels[tag]:
                # real data won the race for this buffer, so our cancel message is left unmatched: take it out
                await self._transport.drain(tag, len(cancels[tag]))
        if stuck:
            log.warning("receives still held by UCX after cancel", transfer_id=self._plan.transfer_id,
                        messages=len(stuck), waited_s=self._transport.drain_timeout)
        self._posted.clear()
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        self._release(wait=True)  # scatters already queued finish before the caller may reuse the pages
        if self._in_place:
            # messages went straight into the pages, checked only once they had arrived: whatever a refused, cut or
            # forged one left there goes, so the pages hold finite values again (Contract 1) and nothing of it
            # reaches their next user (a local prefill of this prompt leaves its last page's tail unwritten)
            torch._foreach_zero_([p for msg in self._plan.messages for p in self._layout.pool(msg)[0]])
            if self._dst.is_cuda:
                torch.cuda.current_stream(self._dst.device).synchronize()


class UcxTransport:
    """KVTransport over UCX (ucxx): shared memory (sysv + cma) between processes of one host, TCP between hosts,
    cuda_ipc between GPUs of one host.

    `options` are UCX settings without the `UCX_` prefix (e.g. {"TLS": "tcp,self,sm"}); they apply when this
    is the first UCX user of the process. `window`: messages a receive keeps posted and a push keeps in flight
    (4: a message's completion round trip, through UCX's progress thread and asyncio, overlaps three transfers;
    the decode side holds window x max_message_bytes of staging per transfer on its GPU).
    """

    name = "ucx"

    def __init__(self, options: dict[str, str] | None = None, window: int = 4, drain_timeout: float = 5.0,
                 pool_bytes: int = 512 << 20, in_place: bool = True):
        # ucxx pins UCX_MAX_RNDV_RAILS to 1; 2 lets a TCP rendezvous use both loopback and eth0 lanes
        self.options = {"MAX_RNDV_RAILS": "2", **(options or {})}
        self.window = window
        # pages in runs sent from and received into the pools' pages (plans of pieces, ucp.py); False: staged on
        # both sides, each message one UCX message
        self.in_place = in_place
        self.drain_timeout = drain_timeout
        self.pool = BufferPool(pool_bytes)
        self._gathers = _Gathers()
        self._listener: Any = None
        self._accepted: list[Any] = []  # endpoints prefill nodes opened to us: kept alive with the transport
        self._endpoints: dict[tuple[str, int], Any] = {}
        # held by every post from a producer's side (Outbox._deliver) and while an endpoint is dropped
        self._posting = threading.Lock()
        self._self_ep: Any = None

    async def start(self, listen: bool) -> None:
        import ucxx

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            # UCX calls from this thread need a current CUDA context; ucxx's progress thread makes device 0's
            # current, so a process runs on one GPU, listed first in CUDA_VISIBLE_DEVICES (as dask-cuda does)
            from ucxx._cuda_context import ensure_cuda_context

            ensure_cuda_context(0)
        # on a GPU host ucxx's progress thread spins rather than sleeping on the worker's event fd: the cuda_ipc
        # transfers ran at 50 / 66 % of p2p sleeping and 59 / 76 % spinning (two H200s, session 15 window 2, 2 GiB in
        # 256 MiB / 1 GiB messages; every path gained 3-15 points). It costs a core per process, which a GPU host
        # has and this project's 2-core CPU machine has not (spinning slowed every path there, session 11)
        mode = None if "UCXPY_PROGRESS_MODE" in os.environ or not cuda else "thread-polling"
        with contextlib.suppress(RuntimeError):  # already initialized by another transport of this process
            ucxx.init(options=self.options, progress_mode=mode)
        ucxx.continuous_ucx_progress()
        if torch.cuda.is_available() and torch.cuda.is_initialized() and "cuda_copy" not in (
                tls := ucxx.get_active_transports()):
            raise TransportError("UCX has no CUDA transport (its CUDA module did not load, or UCX_TLS leaves it "
                                 f"out): CUDA buffers would be taken for host memory; transports: {sorted(tls)}")
        if listen and self._listener is None:
            self._listener = _api().UCXListener.create(_worker(), 0, self._accept, (), deliver_endpoint=False)

    def _accept(self, conn_request: int, *_: Any) -> None:
        # UCX's progress thread: accept with the same (no) error handling as the connecting side
        self._accepted.append(self._listener.create_endpoint_from_conn_request(conn_request, False))

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("transport is not listening")
        return self._listener.port

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> UcxReceive:
        return UcxReceive(self, plan, rows, dst_pages, self.window)

    def outbox(self, plan: TransferPlan, device: torch.device, in_place: bool = False) -> Outbox:
        return Outbox(plan, device, self.pool, self._gathers, self._posting, in_place and self.in_place)

    async def send_to_self(self, data: bytes, tag: int) -> None:
        if self._self_ep is None:
            self._self_ep = _api().UCXEndpoint.create(_worker(), "127.0.0.1", self.port, False)
        await _send(self._self_ep, bytearray(data), tag)

    async def drain(self, tag: int, nbytes: int) -> None:
        import ucxx

        with contextlib.suppress(Exception):
            await asyncio.wait_for(ucxx.recv(bytearray(nbytes), tag), self.drain_timeout)

    def _endpoint(self, host: str, port: int) -> Any:
        # one endpoint per decode side, shared by its transfers; it connects in the background, and a refused
        # connection fails the first send (UCXXNotConnectedError)
        key = (host, port)
        if key not in self._endpoints:
            self._endpoints[key] = _api().UCXEndpoint.create(_worker(), host, port, False)
        return self._endpoints[key]

    def _drop(self, host: str, port: int) -> None:
        with self._posting:  # no post on it from a producer's side from here on (_post_pieces checks)
            ep = self._endpoints.pop((host, port), None)
        if ep is not None:
            ep.close_blocking(period=10**8, max_attempts=1)

    async def push(self, host: str, port: int, outbox: Outbox) -> None:
        plan = outbox.plan
        try:
            ep = self._endpoint(host, port)
        except Exception as e:
            raise TransportError(f"cannot connect to decode transport {host}:{port}: {e!r}") from e
        in_flight: deque[tuple[asyncio.Future, torch.Tensor | _InPlace]] = deque()
        task, abandoned = asyncio.current_task(), []

        def abandon() -> None:  # Outbox.wait_released gave up on the sends in flight
            abandoned.append(True)
            self._drop(host, port)
            task.cancel()

        outbox.abandon = abandon
        if plan.pieces:  # the producer's side posts each message as soon as it is ready (Outbox._deliver)
            outbox.start_sending(functools.partial(self._post_pieces, ep, host, port, plan, asyncio.get_running_loop()))
        try:
            for expected in range(len(plan.messages)):
                index, item, send = await outbox.get()
                if index != expected:
                    raise TransportError(f"transfer {plan.transfer_id}: message {index} queued before {expected}")
                if isinstance(send, Exception):  # the producer's side failed to post it
                    raise self._send_failed(host, port, send) from send
                if send is None:  # not posted by the producer's side: here
                    if len(in_flight) >= self.window and not isinstance(item, _InPlace):  # in place: nothing staged
                        await self._finish(in_flight, host, port, plan)
                    if isinstance(item, _InPlace) or plan.pieces:
                        send = self._send_ucp(ep, plan, index, item, host, port)
                    else:
                        send = _start_send(ep, _ucx_buffer(item), plan.tag(index))
                send.add_done_callback(outbox.count_sent)
                in_flight.append((send, item))
            while in_flight:
                await self._finish(in_flight, host, port, plan)
        except asyncio.CancelledError:
            if abandoned:  # its endpoint is gone: the sends in flight will not finish
                raise TransportError(f"push of transfer {plan.transfer_id} to {host}:{port} dropped: its sends "
                                     "held the node's pages past the producer's bound") from None
            # the endpoint is shared by every transfer to this decode side: let the messages in flight (with those
            # the producer's side posted and the push did not take yet) finish rather than abort it, unless they
            # cannot finish in time
            in_flight.extend(await outbox.stop_sending())
            if in_flight:
                _, late = await asyncio.wait([send for send, _ in in_flight], timeout=self.drain_timeout)
                if late:
                    self._drop(host, port)
            raise
        finally:
            await outbox.stop_sending()
            outbox.released.set()

    def _post_pieces(self, ep: Any, host: str, port: int, plan: TransferPlan, loop: asyncio.AbstractEventLoop,
                     index: int, item: torch.Tensor | _InPlace) -> asyncio.Future:
        """Post message `index` of a plan of pieces, one UCX message per part, from any thread (off the loop under
        the posting lock: Outbox._deliver); its future is `loop`'s."""
        if self._endpoints.get((host, port)) is not ep:
            raise TransportError(f"the endpoint to {host}:{port} was dropped")
        ep.raise_on_error()  # what ucxx's own send checks first (e.g. a refused connection)
        parts = item.parts if isinstance(item, _InPlace) else _buffer_parts(item, plan, plan.messages[index])
        return ucp.send(ep.handle, ep.worker_handle, parts, plan.tag(index), keep=item, loop=loop)

    def _send_ucp(self, ep: Any, plan: TransferPlan, index: int, item: torch.Tensor | _InPlace, host: str,
                  port: int) -> asyncio.Future:
        try:
            return self._post_pieces(ep, host, port, plan, asyncio.get_running_loop(), index, item)
        except Exception as e:
            raise self._send_failed(host, port, e) from e

    def _send_failed(self, host: str, port: int, e: Exception) -> TransportError:
        """A send to host:port could not be posted: its endpoint is dropped; the error for the push to raise."""
        self._drop(host, port)
        return TransportError(f"send to {host}:{port} failed: {e!r}")

    async def _finish(self, in_flight: deque[tuple[asyncio.Future, torch.Tensor | _InPlace]], host: str, port: int,
                      plan: TransferPlan) -> None:
        """Wait for the oldest send in flight; its buffer goes back to the pool."""
        send, item = in_flight[0]
        try:
            await asyncio.shield(send)  # a cancelled push leaves the sends to its own handler
        except Exception as e:
            self._drop(host, port)
            raise TransportError(f"push of transfer {plan.transfer_id} to {host}:{port} failed: {e!r}") from e
        in_flight.popleft()
        if isinstance(item, torch.Tensor):
            self.pool.give(item)

    async def close(self) -> None:
        for ep in [*self._endpoints.values(), *self._accepted, self._self_ep]:
            if ep is not None:
                with contextlib.suppress(Exception):
                    ep.close_blocking(period=10**8, max_attempts=1)
        self._endpoints.clear()
        self._accepted.clear()
        self._self_ep = None
        self._listener = None
        self._gathers.close()


TRANSPORTS = {"ucx": UcxTransport}
