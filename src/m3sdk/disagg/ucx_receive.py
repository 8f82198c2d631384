"""UcxReceive: the decode side of one transfer over UCX: buffers posted for its messages, each message checked
against the plan, then scattered into the pool's pages (or, for a plan of pieces, received straight into them).
Runs on the disagg loop (loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

import torch

from m3sdk.disagg import ucp, ucx_api, wire
from m3sdk.disagg.outbox import InPlace
from m3sdk.disagg.transport import TransportError
from m3sdk.disagg.wire import MessageSpec, TransferPlan
from m3sdk.observability import get_logger

if TYPE_CHECKING:
    from m3sdk.disagg.ucx_transport import UcxTransport

log = get_logger("m3sdk.disagg.transport")


class UcxReceive:
    """One transfer's receiving side: `window` messages posted at once, each checked then scattered.

    On GPUs two streams of the transfer's own: arming and checks (a zeroed trailer slot, a header and trailer
    copied to the host: the only host wait, so it sees nothing of the engine's queued steps) on one, the
    scatters on the other, queued without a host wait, so the next message's check and post do not wait for
    them. The scatters start after the work the engine queued before the transfer (its pages were freed before:
    a step in flight then may still write them). A buffer goes back to the pool once its scatter ran; the
    transfer counts as done (and a cancel returns) only after every scatter ran. Where each message goes in the
    pool is worked out once, before the first post (wire.Layout), and per message the loop makes a few calls: host
    time per message would otherwise pace the GPU transfer."""

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
            item = InPlace(buf, self._layout.pool(msg)[0])
            self._posted[tag] = (buf, ucp.recv(ucx_api.worker().handle, item.parts, tag, keep=item), msg)
        else:
            self._posted[tag] = (buf, ucx_api.start_recv(ucx_api.ucx_buffer(buf), tag), msg)

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
        with ucx_api.using(io):
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
            with ucx_api.using(io):
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
