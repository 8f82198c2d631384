"""The KV transport seam and its UCX implementation (ucxx).

The decode side posts receive buffers for a transfer's messages (`receive`), the prefill side packs its pages
into messages and pushes them (`push`), and the decode side checks each message against the plan before it
scatters the pages into its pool (wire.py). ucxx offers two-sided tag messaging (no one-sided RMA from
Python), so "posted buffers + scatter" is the shape of the protocol; a one-sided transport (NIXL) would write
pages in place behind the same seam.

Connection direction: the decode side listens; a prefill node connects to the port the decode side declared,
on the address its gRPC call came from. So a node never parses a peer-supplied UCX address (a malformed one
can abort the process inside UCX), and the decode side accepts nothing but messages whose 64-bit tags it
posted, whose headers and trailers it checks.

Every coroutine here runs on the disagg loop (loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import torch

from m3sdk.disagg import wire
from m3sdk.disagg.wire import TransferPlan


class TransportError(RuntimeError):
    """The transport could not move a transfer (peer gone, connection refused, message refused)."""


class Receive(Protocol):
    async def wait(self) -> None:
        """Return once every message arrived, was checked and scattered; raise TransportError otherwise."""

    async def cancel(self) -> None:
        """Retire the posted buffers; once this returns no page of the transfer is written any more."""


class KVTransport(Protocol):
    name: str

    async def start(self, listen: bool) -> None:
        """Initialize; `listen` (decode side) opens the port prefill nodes push to."""

    @property
    def port(self) -> int: ...

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> Receive:
        """Post buffers for `plan` and scatter each checked message into `rows` at `dst_pages`."""

    async def push(self, host: str, port: int, plan: TransferPlan, rows: list[list[torch.Tensor]],
                   src_pages: torch.Tensor) -> None:
        """Pack `src_pages` of `rows` message by message and send them to the decode side at host:port."""

    async def close(self) -> None: ...


def _ucx_buffer(t: torch.Tensor) -> Any:
    # ucxx takes the buffer protocol (numpy for host memory) or __cuda_array_interface__ (CUDA tensors)
    return t if t.is_cuda else t.numpy()


class UcxReceive:
    """One transfer's receiving side: `window` messages posted at once, each checked then scattered."""

    def __init__(self, transport: UcxTransport, plan: TransferPlan, rows: list[list[torch.Tensor]],
                 dst_pages: torch.Tensor, window: int):
        self._transport, self._plan, self._rows, self._dst = transport, plan, rows, dst_pages
        self._window = window
        self._posted: dict[int, tuple[torch.Tensor, asyncio.Future]] = {}
        self._cancelled = False
        self._task = asyncio.ensure_future(self._run())

    def _post(self, index: int) -> None:
        import ucxx

        msg = self._plan.messages[index]
        buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=self._dst.device)
        wire.arm(buf)
        fut = asyncio.ensure_future(ucxx.recv(_ucx_buffer(buf), self._plan.tag(index)))
        self._posted[index] = (buf, fut)

    async def _run(self) -> None:
        count = len(self._plan.messages)
        for index in range(min(self._window, count)):
            self._post(index)
        for index in range(count):
            buf, fut = self._posted[index]
            try:
                await fut
            except Exception as e:  # truncation (a message larger than posted), endpoint errors
                raise TransportError(f"transfer {self._plan.transfer_id} message {index}: {e!r}") from e
            if self._cancelled:
                return
            del self._posted[index]
            try:
                wire.scatter(self._plan, self._plan.messages[index], self._rows, self._dst, buf)
            except wire.WireError as e:
                raise TransportError(str(e)) from e
            if index + self._window < count:
                self._post(index + self._window)

    async def wait(self) -> None:
        try:
            await asyncio.shield(self._task)
        except TransportError:
            await self.cancel()
            raise

    async def cancel(self) -> None:
        self._cancelled = True
        open_ = {i: (buf, fut) for i, (buf, fut) in self._posted.items() if not fut.done()}
        for index in open_:
            await self._transport.send_to_self(wire.cancel_message(self._plan, self._plan.messages[index]),
                                               self._plan.tag(index))
        for index, (buf, fut) in open_.items():
            with contextlib.suppress(Exception):
                await fut
            if not wire.is_cancel(buf):
                # real data won the race for this buffer, so our cancel message is left unmatched: take it out
                await self._transport.drain(self._plan.tag(index), wire.HEADER_BYTES)
        self._posted.clear()
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


class UcxTransport:
    """KVTransport over UCX (ucxx): TCP and shared memory on CPUs, cuda_ipc between GPUs of one host.

    `options` are UCX settings without the `UCX_` prefix (e.g. {"TLS": "tcp,self,sm"}); they apply when this
    is the first UCX user of the process. ucxx pins UCX_MAX_RNDV_RAILS to 1; 2 about doubles loopback TCP.
    """

    name = "ucx"

    def __init__(self, options: dict[str, str] | None = None, window: int = 2, connect_timeout: float = 5.0,
                 drain_timeout: float = 5.0):
        self.options = {"MAX_RNDV_RAILS": "2", **(options or {})}
        self.window = window
        self.connect_timeout = connect_timeout
        self.drain_timeout = drain_timeout
        self._listener: Any = None
        self._accepted: set[Any] = set()  # endpoints prefill nodes opened to us: kept alive while open
        self._endpoints: dict[tuple[str, int], Any] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}
        self._self_ep: Any = None

    async def start(self, listen: bool) -> None:
        import ucxx

        with contextlib.suppress(RuntimeError):  # already initialized by another transport of this process
            ucxx.init(options=self.options)
        if listen and self._listener is None:
            self._listener = ucxx.create_listener(self._accept, 0, connect_timeout=self.connect_timeout)

    def _accept(self, ep: Any) -> None:
        self._accepted.add(ep)
        ep.set_close_callback(self._accepted.discard, cb_args=(ep,))

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("transport is not listening")
        return self._listener.port

    def receive(self, plan: TransferPlan, rows: list[list[torch.Tensor]], dst_pages: torch.Tensor) -> UcxReceive:
        return UcxReceive(self, plan, rows, dst_pages, self.window)

    async def send_to_self(self, data: bytes, tag: int) -> None:
        import ucxx

        if self._self_ep is None or self._self_ep.closed:
            self._self_ep = await ucxx.create_endpoint("127.0.0.1", self.port, connect_timeout=self.connect_timeout)
        await self._self_ep.send(bytearray(data), tag=tag, force_tag=True)

    async def drain(self, tag: int, nbytes: int) -> None:
        import ucxx

        with contextlib.suppress(Exception):
            await asyncio.wait_for(ucxx.recv(bytearray(nbytes), tag), self.drain_timeout)

    async def _endpoint(self, host: str, port: int) -> Any:
        import ucxx

        key = (host, port)
        ep = self._endpoints.get(key)
        if ep is not None and not ep.closed:
            return ep
        if key not in self._connecting:  # one connection per peer even when its prefills start together
            self._connecting[key] = asyncio.ensure_future(
                ucxx.create_endpoint(host, port, connect_timeout=self.connect_timeout))
        connecting = self._connecting[key]
        try:
            ep = await asyncio.shield(connecting)
        except Exception as e:
            raise TransportError(f"cannot connect to decode transport {host}:{port}: {e!r}") from e
        finally:
            if self._connecting.get(key) is connecting and connecting.done():
                del self._connecting[key]
        self._endpoints[key] = ep
        return ep

    def _drop(self, host: str, port: int) -> None:
        ep = self._endpoints.pop((host, port), None)
        if ep is not None:
            ep.abort()

    async def push(self, host: str, port: int, plan: TransferPlan, rows: list[list[torch.Tensor]],
                   src_pages: torch.Tensor) -> None:
        ep = await self._endpoint(host, port)
        largest = max(m.nbytes for m in plan.messages)
        # two buffers: the next message is packed while the previous one is on the wire
        bufs = [torch.empty(largest, dtype=torch.uint8, device=src_pages.device) for _ in range(2)]
        in_flight = None
        for msg in plan.messages:
            out = bufs[msg.index % 2][:msg.nbytes]
            wire.pack(plan, msg, rows, src_pages, out)
            if in_flight is not None:
                await self._finish(in_flight, host, port, plan)
            in_flight = asyncio.ensure_future(ep.send(_ucx_buffer(out), tag=plan.tag(msg.index), force_tag=True))
        await self._finish(in_flight, host, port, plan)

    async def _finish(self, send: asyncio.Future, host: str, port: int, plan: TransferPlan) -> None:
        try:
            await asyncio.shield(send)
        except asyncio.CancelledError:
            # the endpoint is shared by every transfer to this decode side: let the message in flight finish
            # rather than abort it, unless it cannot finish in time
            try:
                await asyncio.wait_for(send, self.drain_timeout)
            except Exception:
                self._drop(host, port)
            raise
        except Exception as e:
            self._drop(host, port)
            raise TransportError(f"push of transfer {plan.transfer_id} to {host}:{port} failed: {e!r}") from e

    async def close(self) -> None:
        for ep in [*self._endpoints.values(), *self._accepted, self._self_ep]:
            if ep is not None and not ep.closed:
                with contextlib.suppress(Exception):
                    ep.abort()
        self._endpoints.clear()
        self._accepted.clear()
        self._self_ep = None
        self._listener = None


TRANSPORTS = {"ucx": UcxTransport}
