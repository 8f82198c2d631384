"""UcxTransport: the KVTransport over UCX (ucxx).

ucxx offers two-sided tag messaging (no one-sided RMA from Python), so "posted buffers + scatter" is the shape of
the protocol. A decode side whose pages form runs (`in_place`, the default) asks for plans of pieces: each message
travels as one UCX message per part (header, each (layer, tensor, run) piece, trailer; ucp.py, ctypes on libucp)
straight from the node's pages into its own, so neither side copies; the node keeps its pages until the sends let
go of them (Outbox.wait_released), the decode side checks header and trailer once the message arrived and zeroes
a failed transfer's pages (UcxReceive.cancel).

Endpoints are created without UCX peer error handling. With it, UCX (1.21) keeps shared memory out of an
endpoint's lanes and moves every byte over TCP even between processes of one host (UCX_LOG_LEVEL=info:
"tag(tcp/lo)"; without it: "tag(sysv/memory cma/memory)"; docs/perf.md has the rates). A dead peer is still
noticed: a refused connection or a peer gone mid-message fails the request (UCXXNotConnectedError,
UCXXConnectionResetError), and what UCX cannot see (a peer that dies with nothing in flight) the deadlines and
gRPC heartbeats of client.py and server.py catch. ucxx's create_listener/create_endpoint always enable error
handling, so the binding layer (`ucxx._lib.libucxx`, ucx_api.api) is used directly here.

What UCX does not survive without peer error handling is a send on an endpoint whose connection was refused: the
send never fails, UCX's progress thread retries it forever (a core spinning, no transfer of the process moving
again) and the next post blocks its caller, the disagg loop, on the request's lock; every gRPC call of the node
then goes unanswered. So an endpoint is created only after a plain TCP connection to the decode side's port was
accepted within `connect_timeout` (asynchronously, on the loop): a closed port or a host that does not answer
fails the push at once with TransportError.

Every coroutine here runs on the disagg loop (loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections import deque
from typing import Any

import torch

from m3sdk.disagg import ucp, ucx_api
from m3sdk.disagg.outbox import BufferPool, DeviceWaits, InPlace, Outbox, buffer_parts
from m3sdk.disagg.transport import TRANSPORTS, TransportError
from m3sdk.disagg.ucx_receive import UcxReceive
from m3sdk.disagg.wire import TransferPlan


@TRANSPORTS.register("ucx")
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
                 pool_bytes: int = 512 << 20, in_place: bool = True, connect_timeout: float = 2.0):
        ucx_api.set_environment()
        # ucxx pins UCX_MAX_RNDV_RAILS to 1; 2 lets a TCP rendezvous use both loopback and eth0 lanes
        self.options = {"MAX_RNDV_RAILS": "2", **(options or {})}
        self.window = window
        # pages in runs sent from and received into the pools' pages (plans of pieces, ucp.py); False: staged on
        # both sides, each message one UCX message
        self.in_place = in_place
        self.drain_timeout = drain_timeout
        self.connect_timeout = connect_timeout  # seconds a decode side's port has to accept a TCP connection
        self.pool = BufferPool(pool_bytes)
        self._gathers = DeviceWaits()
        self._port: int | None = None  # the process's listener's (ucx_api.listener), once listening
        self._endpoints: dict[tuple[str, int], Any] = {}
        # held by every post from a producer's side (Outbox._deliver) and while an endpoint is dropped
        self._posting = threading.Lock()
        self._self_ep: Any = None

    async def start(self, listen: bool) -> None:
        ucxx = ucx_api.load_ucxx()

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            # UCX calls from this thread need a current CUDA context; ucxx's progress thread makes device 0's
            # current, so a process runs on one GPU, listed first in CUDA_VISIBLE_DEVICES (as dask-cuda does)
            from ucxx._cuda_context import ensure_cuda_context

            ensure_cuda_context(0)
        # on a GPU host ucxx's progress thread spins rather than sleeping on the worker's event fd: every cuda_ipc
        # path moves faster so (docs/perf.md). It costs a core per process, which a GPU host has and a small CPU
        # machine has not (spinning slows every path there)
        mode = None if "UCXPY_PROGRESS_MODE" in os.environ or not cuda else "thread-polling"
        with contextlib.suppress(RuntimeError):  # already initialized by another transport of this process
            ucxx.init(options=self.options, progress_mode=mode)
        ucxx.continuous_ucx_progress()
        if torch.cuda.is_available() and torch.cuda.is_initialized() and "cuda_copy" not in (
                tls := ucxx.get_active_transports()):
            raise TransportError("UCX has no CUDA transport (its CUDA module did not load, or UCX_TLS leaves it "
                                 f"out): CUDA buffers would be taken for host memory; transports: {sorted(tls)}")
        if listen:
            self._port = ucx_api.listener().port

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("transport is not listening")
        return self._port

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> UcxReceive:
        return UcxReceive(self, plan, rows, dst_pages, self.window)

    def outbox(self, plan: TransferPlan, device: torch.device, in_place: bool = False) -> Outbox:
        return Outbox(plan, device, self.pool, self._gathers, self._posting, in_place and self.in_place)

    async def send_to_self(self, data: bytes, tag: int) -> None:
        if self._self_ep is None:
            self._self_ep = ucx_api.api().UCXEndpoint.create(ucx_api.worker(), "127.0.0.1", self.port, False)
        await ucx_api.send(self._self_ep, bytearray(data), tag)

    async def drain(self, tag: int, nbytes: int) -> None:
        ucxx = ucx_api.load_ucxx()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.drain_timeout):  # not wait_for: see _endpoint
                await ucxx.recv(bytearray(nbytes), tag)

    async def _endpoint(self, host: str, port: int) -> Any:
        # one endpoint per decode side, shared by its transfers; created once the port accepted a TCP connection
        # (module docstring: a send on a refused endpoint never ends)
        key = (host, port)
        if key not in self._endpoints:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the connection when it completes as
                # the caller is cancelled, and a push cancelled then (its prefill failed) would wait for messages
                # that never come
                async with asyncio.timeout(self.connect_timeout):
                    _, writer = await asyncio.open_connection(host, port)
            except (OSError, TimeoutError) as e:
                raise TransportError(f"decode transport {host}:{port} accepted no connection within "
                                     f"{self.connect_timeout:.1f} s: {e!r}") from e
            writer.close()
            if key not in self._endpoints:  # another push to it may have created it meanwhile
                self._endpoints[key] = ucx_api.api().UCXEndpoint.create(ucx_api.worker(), host, port, False)
        return self._endpoints[key]

    def _drop(self, host: str, port: int) -> None:
        with self._posting:  # no post on it from a producer's side from here on (_post_pieces checks)
            ep = self._endpoints.pop((host, port), None)
        if ep is not None:
            ep.close_blocking(period=10**8, max_attempts=1)

    async def push(self, host: str, port: int, outbox: Outbox) -> None:
        plan = outbox.plan
        try:
            ep = await self._endpoint(host, port)
        except BaseException as e:
            outbox.released.set()  # nothing was sent: the producer's pages are free now
            if isinstance(e, Exception) and not isinstance(e, TransportError):
                raise TransportError(f"cannot connect to decode transport {host}:{port}: {e!r}") from e
            raise
        in_flight: deque[tuple[asyncio.Future, torch.Tensor | InPlace]] = deque()
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
                    if len(in_flight) >= self.window and not isinstance(item, InPlace):  # in place: nothing staged
                        await self._finish(in_flight, host, port, plan)
                    if isinstance(item, InPlace) or plan.pieces:
                        send = self._send_ucp(ep, plan, index, item, host, port)
                    else:
                        send = ucx_api.start_send(ep, ucx_api.ucx_buffer(item), plan.tag(index))
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
                     index: int, item: torch.Tensor | InPlace) -> asyncio.Future:
        """Post message `index` of a plan of pieces, one UCX message per part, from any thread (off the loop under
        the posting lock: Outbox._deliver); its future is `loop`'s."""
        if self._endpoints.get((host, port)) is not ep:
            raise TransportError(f"the endpoint to {host}:{port} was dropped")
        ep.raise_on_error()  # what ucxx's own send checks first (e.g. a refused connection)
        parts = item.parts if isinstance(item, InPlace) else buffer_parts(item, plan, plan.messages[index])
        return ucp.send(ep.handle, ep.worker_handle, parts, plan.tag(index), keep=item, loop=loop)

    def _send_ucp(self, ep: Any, plan: TransferPlan, index: int, item: torch.Tensor | InPlace, host: str,
                  port: int) -> asyncio.Future:
        try:
            return self._post_pieces(ep, host, port, plan, asyncio.get_running_loop(), index, item)
        except Exception as e:
            raise self._send_failed(host, port, e) from e

    def _send_failed(self, host: str, port: int, e: Exception) -> TransportError:
        """A send to host:port could not be posted: its endpoint is dropped; the error for the push to raise."""
        self._drop(host, port)
        return TransportError(f"send to {host}:{port} failed: {e!r}")

    async def _finish(self, in_flight: deque[tuple[asyncio.Future, torch.Tensor | InPlace]], host: str, port: int,
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
        for ep in [*self._endpoints.values(), self._self_ep]:
            if ep is not None:
                with contextlib.suppress(Exception):
                    ep.close_blocking(period=10**8, max_attempts=1)
        self._endpoints.clear()
        self._self_ep = None
        self._port = None
        self._gathers.close()
