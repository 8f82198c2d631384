"""The prefill node's gRPC service: handshake, Prefill (compute, then push pages over the KV transport),
Abort, Health; plus the server around it (message size cap, optional shared token and TLS).

Every call is checked (messages.py) before anything is computed; a refused call gets a status naming the
problem and the server keeps serving. Abort is idempotent and so is a second Prefill with a live id refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from m3sdk.disagg import wire
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb
from m3sdk.disagg._proto import m3sdk_disagg_pb2_grpc as pb_grpc
from m3sdk.disagg.compat import PROTOCOL_VERSION, CompatInfo
from m3sdk.disagg.messages import Limits, PrefillOrder, check_prefill
from m3sdk.disagg.outbox import Outbox
from m3sdk.disagg.transport import KVTransport, TransportError
from m3sdk.observability import get_logger

log = get_logger("m3sdk.disagg.server")

TOKEN_HEADER = "authorization"


@dataclass(frozen=True)
class FirstToken:
    """What the node's compute produced besides the pages: the first sampled token (with its top-n logprobs
    when the request asked for them)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


class PrefillBackend(Protocol):
    """What computes prompts for the node (an engine core of its own)."""

    compat: CompatInfo
    vocab_size: int
    rows: list[list[torch.Tensor]]  # its pool's page rows (wire.page_rows): the plan is cut from their widths
    # it keeps the pages it packed unchanged until `outbox.wait_released` returned: they may be sent in place
    holds_pages: bool

    async def prefill(self, order: PrefillOrder, outbox: Outbox) -> FirstToken:
        """Run the prompt and pack every message of `outbox.plan` into `outbox` (the pages the order names, as
        soon as they are computed); cancelling the call aborts it and frees what it holds."""

    def pages(self) -> tuple[int, int]:
        """(free, total) pages of its KV cache."""


def peer_host(peer: str) -> str:
    """The IP address in a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    raise ValueError(f"cannot push KV to a peer at {peer!r} (only TCP peers)")


class PrefillServicer(pb_grpc.PrefillNodeServicer):
    def __init__(self, backend: PrefillBackend, transport: KVTransport, limits: Limits, node_id: str):
        self.backend, self.transport, self.limits, self.node_id = backend, transport, limits, node_id
        self.compat_hash = backend.compat.digest
        self.draining = False
        self._running: dict[str, tuple[asyncio.Task, int]] = {}  # request id -> (work, prompt tokens)

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeReply:
        if self.draining:  # a client that saw it draining retries the handshake: keep it away
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is draining")
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol version {request.protocol_version} != node's {PROTOCOL_VERSION}")
        theirs = CompatInfo.from_proto(request.compat)
        diff = self.backend.compat.differences(theirs)
        if diff:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "incompatible KV cache (node != decode): " + "; ".join(diff))
        if self.transport.name not in request.transports:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no common KV transport: node has {self.transport.name!r}, decode offers "
                                f"{list(request.transports)}")
        return pb.HandshakeReply(protocol_version=PROTOCOL_VERSION, compat=self.backend.compat.to_proto(),
                                 transport=self.transport.name, max_prompt_tokens=self.limits.max_prompt_tokens,
                                 max_message_bytes=self.limits.max_message_bytes, node_id=self.node_id)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is draining")
        try:
            order = check_prefill(request, self.limits, self.compat_hash, self.backend.vocab_size,
                                  self.backend.compat.num_layers)
            host = peer_host(context.peer())
            # the plan checks the cut too (a max_message_bytes below one page of a group): the caller's error
            plan = wire.TransferPlan.build(self.backend.rows, order.transfer_id,
                                           order.num_pages - order.num_cached_pages, order.layers_per_group,
                                           order.max_message_bytes, order.dst_pages, order.pieces)
        except ValueError as e:  # WireError included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if order.request_id in self._running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {order.request_id!r} is running")
        if len(self._running) >= self.limits.max_in_flight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "node is at max_in_flight prefills")
        # The work runs as a task of its own, so Abort can cancel it while this handler reports why.
        work = asyncio.ensure_future(asyncio.wait_for(self._serve(order, plan, host), order.deadline - time.time()))
        self._running[order.request_id] = (work, len(order.token_ids))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.cancelled() and not context.cancelled():
                await context.abort(grpc.StatusCode.ABORTED, f"request {order.request_id!r} was aborted")
            raise  # the caller went away: cancel the work below
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed on the node")
        except (TransportError, wire.WireError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pushing pages failed: {e}")
        except RuntimeError as e:  # the backend could not compute it (aborted in the engine, engine died)
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed on the node: {e}")
        finally:
            work.cancel()
            self._running.pop(order.request_id, None)

    async def _serve(self, order: PrefillOrder, plan: wire.TransferPlan, host: str) -> pb.PrefillReply:
        outbox = self.transport.outbox(plan, self.backend.rows[0][0].device, in_place=self.backend.holds_pages)
        # the push starts with the compute: it sends each group of layers as the backend packs it
        push = asyncio.ensure_future(self.transport.push(host, order.transport_port, outbox))
        compute = asyncio.ensure_future(self.backend.prefill(order, outbox))
        try:
            done, _ = await asyncio.wait((push, compute), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            first = await compute
            await push
        finally:
            for task in (push, compute):
                task.cancel()
            await asyncio.gather(push, compute, return_exceptions=True)
        top = first.top_logprobs or ()
        return pb.PrefillReply(first_token=first.token_id, first_logprob=first.logprob,
                               top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top],
                               num_prompt_tokens=len(order.token_ids), num_pages_sent=plan.num_pages,
                               num_messages_sent=len(plan.messages), bytes_sent=plan.total_bytes)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        entry = self._running.get(request.request_id)
        if entry is not None:
            entry[0].cancel()
        return pb.AbortReply(was_running=entry is not None)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        free, total = self.backend.pages()
        return pb.HealthReply(serving=not self.draining, running=len(self._running),
                              waiting_tokens=sum(n for _, n in self._running.values()), pages_free=free,
                              pages_total=total)

    async def drain(self, timeout: float) -> None:
        """Refuse new prefills; wait up to `timeout` for the running ones, then abort what is left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for work, _ in list(self._running.values()):
            work.cancel()


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Calls without `authorization: Bearer <token>` are refused before any handler runs."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        got = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        return grpc.unary_unary_rpc_method_handler(refuse)


async def start_server(servicer: PrefillServicer, listen: str, token: str | None = None,
                       tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve on `listen` ("HOST:PORT", port 0 picks one); `tls` is (PEM key, PEM certificate chain).
    Returns the started server and its port."""
    host, port = check_listen(listen)
    limit = servicer.limits.max_call_bytes
    # so_reuseport off: a port in use fails to bind (by default gRPC would add a second listener on it)
    server = grpc.aio.server(
        interceptors=[_TokenCheck(token)] if token else None,
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", 1 << 20),
                 ("grpc.so_reuseport", 0)])
    pb_grpc.add_PrefillNodeServicer_to_server(servicer, server)
    try:
        if tls is not None:
            bound = server.add_secure_port(listen, grpc.ssl_server_credentials([tls]))
        else:
            if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
                log.warning("prefill node listens beyond loopback without TLS", listen=listen)
            bound = server.add_insecure_port(listen)
    except RuntimeError as e:  # grpc's "Failed to bind": in use since check_listen, or not an address here
        raise OSError(f"cannot listen on {listen}: {e}") from e
    if port and bound != port:
        raise OSError(f"cannot listen on {listen}: bound port {bound} instead")
    await server.start()
    return server, bound


def check_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port), refusing a port something already listens on. Checked with a socket of our own
    before gRPC binds, whose failure would log lines of its C core first."""
    host, _, port_text = listen.rpartition(":")
    if not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    port = int(port_text)
    if port:
        bare = host.strip("[]")
        try:
            socket.create_server((bare, port), family=socket.AF_INET6 if ":" in bare else socket.AF_INET).close()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f"cannot listen on {listen}: the port is in use") from None
            # anything else (a host that is not an address of this machine): gRPC's bind reports it
    return host, port


async def stop_server(server: grpc.aio.Server, grace: float) -> None:
    with contextlib.suppress(Exception):
        await server.stop(grace)
