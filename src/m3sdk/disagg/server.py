"""The prefill node's gRPC service: handshake, Prefill (compute, then push pages over the KV transport),
Abort, Health; plus the server around it (message size cap, shared token and/or TLS, loopback unless told).

Every call is checked (messages.py) before anything is computed: a message that is not protobuf is
INVALID_ARGUMENT, a prompt longer than the node's KV cache holds is refused naming the limit, and a refused
call's status names the problem in at most MAX_DETAILS bytes (gRPC sends it as metadata). The server keeps
serving. A caller sees and aborts only its own prefills (by the address it calls from); Abort is idempotent and
a second Prefill with a live id is refused. Deadlines are cut to the node's max_deadline_s, and a decode side that
does not take the pages within receiver_timeout_s of the first token frees the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
import torch
from google.protobuf.message import DecodeError

from m3sdk.disagg import wire
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb
from m3sdk.disagg._proto import m3sdk_disagg_pb2_grpc as pb_grpc
from m3sdk.disagg.compat import PROTOCOL_VERSION, CompatInfo
from m3sdk.disagg.messages import Limits, PrefillOrder, check_prefill
from m3sdk.disagg.outbox import Outbox
from m3sdk.disagg.transport import KVTransport, TransportError
from m3sdk.errors import InvalidRequestError
from m3sdk.observability import get_logger

log = get_logger("m3sdk.disagg.server")

TOKEN_HEADER = "authorization"
# status details travel as gRPC metadata (8 KiB of headers by default): an error quoting a caller's field is cut
MAX_DETAILS = 1024


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
    max_prompt_tokens: int  # the longest prompt its KV cache can ever hold (with the first token's room)
    takes_images: bool  # it has a vision encoder: PrefillOrder.images are decoded and encoded there


    async def prefill(self, order: PrefillOrder, outbox: Outbox) -> FirstToken:
        """Run the prompt (its images decoded and checked first: InvalidRequestError when they do not match the
        prompt) and pack every message of `outbox.plan` into `outbox` (the pages the order names, as soon as they
        are computed); cancelling the call aborts it and frees what it holds."""

    def pages(self) -> tuple[int, int]:
        """(free, total) pages of its KV cache."""

    def failure(self) -> BaseException | None:
        """Why it can compute no more (its engine thread died); None while it serves."""


def peer_host(peer: str) -> str:
    """The IP address in a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    raise ValueError(f"cannot push KV to a peer at {peer!r} (only TCP peers)")


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    raw = details.encode("utf-8", "replace")
    if len(raw) > MAX_DETAILS:
        details = raw[:MAX_DETAILS - 40].decode("utf-8", "ignore") + f"... ({len(raw)} bytes)"
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Who calls, for scoping their prefills: the address the call comes from (the node pushes pages there)."""
    try:
        return peer_host(context.peer())
    except ValueError:
        return context.peer()


class PrefillServicer(pb_grpc.PrefillNodeServicer):
    def __init__(self, backend: PrefillBackend, transport: KVTransport, limits: Limits, node_id: str):
        self.backend, self.transport, self.node_id = backend, transport, node_id
        # no prompt the KV cache can never hold: the scheduler would wait on it forever; no images without an
        # encoder
        self.limits = dataclasses.replace(limits, max_prompt_tokens=min(limits.max_prompt_tokens,
                                                                        backend.max_prompt_tokens),
                                          max_image_bytes=limits.max_image_bytes if backend.takes_images else 0)
        self.compat_hash = backend.compat.digest
        self.draining = False
        # (caller, request id) -> (work, prompt tokens)
        self._running: dict[tuple[str, str], tuple[asyncio.Task, int]] = {}
        self._winding_down: set[asyncio.Task] = set()  # pushes to receivers that did not read, still ending

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _failure(self) -> str:
        """Why no new prefill is taken ("" when they are)."""
        if (dead := self.backend.failure()) is not None:
            return f"the node's engine failed: {dead!r}"
        return "node is draining" if self.draining else ""

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeReply:
        if why := self._failure():  # a client that saw it draining retries the handshake: keep it away
            await _abort(context, grpc.StatusCode.UNAVAILABLE, why)
        if request.protocol_version != PROTOCOL_VERSION:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"protocol version {request.protocol_version} != node's {PROTOCOL_VERSION}")
        theirs = CompatInfo.from_proto(request.compat)
        diff = self.backend.compat.differences(theirs)
        if diff:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         "incompatible KV cache (node != decode): " + "; ".join(diff))
        if self.transport.name not in request.transports:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"no common KV transport: node has {self.transport.name!r}, decode offers "
                         f"{list(request.transports)}")
        limits = self.limits
        return pb.HandshakeReply(protocol_version=PROTOCOL_VERSION, compat=self.backend.compat.to_proto(),
                                 transport=self.transport.name, max_prompt_tokens=limits.max_prompt_tokens,
                                 max_message_bytes=limits.max_message_bytes, node_id=self.node_id,
                                 max_in_flight=limits.max_in_flight, max_deadline_s=limits.max_deadline_s,
                                 receiver_timeout_s=limits.receiver_timeout_s,
                                 max_image_bytes=limits.max_image_bytes)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        if why := self._failure():
            await _abort(context, grpc.StatusCode.UNAVAILABLE, why)
        try:
            order = check_prefill(request, self.limits, self.compat_hash, self.backend.vocab_size,
                                  self.backend.compat.num_layers)
            host = peer_host(context.peer())
            # the plan checks the cut too (a max_message_bytes below one page of a group): the caller's error
            plan = wire.TransferPlan.build(self.backend.rows, order.transfer_id,
                                           order.num_pages - order.num_cached_pages, order.layers_per_group,
                                           order.max_message_bytes, order.dst_pages, order.pieces)
        except ValueError as e:  # WireError included
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        key = (host, order.request_id)
        if key in self._running:
            await _abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request {order.request_id!r} is running")
        if len(self._running) >= self.limits.max_in_flight:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"node is at its max_in_flight of {self.limits.max_in_flight} prefills")
        # The work runs as a task of its own, so Abort can cancel it while this handler reports why.
        work = asyncio.ensure_future(asyncio.wait_for(self._serve(order, plan, host), order.deadline - time.time()))
        self._running[key] = (work, len(order.token_ids))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.cancelled() and not context.cancelled():
                await _abort(context, grpc.StatusCode.ABORTED, f"request {order.request_id!r} was aborted")
            raise  # the caller went away: cancel the work below
        except TimeoutError:
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed on the node")
        except InvalidRequestError as e:  # its images do not match its prompt here
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (TransportError, wire.WireError) as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"pushing pages failed: {e}")
        except RuntimeError as e:  # the backend could not compute it (aborted in the engine, engine died)
            await _abort(context, grpc.StatusCode.INTERNAL, f"prefill failed on the node: {e}")
        finally:
            work.cancel()
            self._running.pop(key, None)

    async def _serve(self, order: PrefillOrder, plan: wire.TransferPlan, host: str) -> pb.PrefillReply:
        outbox = self.transport.outbox(plan, self.backend.rows[0][0].device, in_place=self.backend.holds_pages)
        # the push starts with the compute: it sends each group of layers as the backend packs it
        push = asyncio.ensure_future(self.transport.push(host, order.transport_port, outbox))
        compute = asyncio.ensure_future(self.backend.prefill(order, outbox))
        try:
            done, _ = await asyncio.wait((push, compute), return_when=asyncio.FIRST_COMPLETED)
            for task in done:  # a failure of either ends the prefill
                task.result()
            first = await compute
            # the pages are all packed: a decode side that does not take them (a closed transport port, a stalled
            # process) must not hold this slot until the caller's deadline
            bound = self.limits.receiver_timeout_s
            _, late = await asyncio.wait((push,), timeout=bound)
            if late:
                # the push winds down on its own (its sends in flight get the transport's drain_timeout, then its
                # endpoint is dropped): the slot is free now
                push.cancel()
                self._winding_down.add(push)
                push.add_done_callback(self._winding_down.discard)
                raise TransportError(f"the decode side took not every page within {bound:.1f} s of the first "
                                     "token (receiver_timeout_s)")
            push.result()
        finally:
            tasks = [t for t in (push, compute) if t not in self._winding_down]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        top = first.top_logprobs or ()
        return pb.PrefillReply(first_token=first.token_id, first_logprob=first.logprob,
                               top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top],
                               num_prompt_tokens=len(order.token_ids), num_pages_sent=plan.num_pages,
                               num_messages_sent=len(plan.messages), bytes_sent=plan.total_bytes)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        # only the caller's own: another caller learns nothing of it (was_running is False) and stops nothing
        entry = self._running.get((_caller(context), request.request_id))
        if entry is not None:
            entry[0].cancel()
        return pb.AbortReply(was_running=entry is not None)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        free, total = self.backend.pages()
        why = self._failure()
        return pb.HealthReply(serving=not why, running=len(self._running),
                              waiting_tokens=sum(n for _, n in self._running.values()), pages_free=free,
                              pages_total=total, error="" if self.draining else why)

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


def _parsing(method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
             request_type: type) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    """The handler of raw request bytes: what is not a `request_type` message is INVALID_ARGUMENT (grpc's own
    deserializer would answer UNKNOWN)."""

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = request_type.FromString(raw)
        except DecodeError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"not a {request_type.__name__}: {e}")
        return await method(request, context)

    return handle


def _add_servicer(servicer: PrefillServicer, server: grpc.aio.Server) -> None:
    service = pb.DESCRIPTOR.services_by_name["PrefillNode"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        reply_type = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _parsing(getattr(servicer, method.name), request_type), response_serializer=reply_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


async def start_server(servicer: PrefillServicer, listen: str, token: str | None = None,
                       tls: tuple[bytes, bytes] | None = None, insecure: bool = False) -> tuple[grpc.aio.Server, int]:
    """Serve on `listen` ("HOST:PORT", port 0 picks one); `tls` is (PEM key, PEM certificate chain).
    Beyond loopback it needs a token or TLS, unless `insecure`. Returns the started server and its port."""
    host, port = check_listen(listen)
    if not is_loopback(host):
        if token is None and tls is None and not insecure:
            raise ValueError(f"refusing to serve on {listen} beyond loopback with neither a token "
                             "($M3SDK_PREFILL_TOKEN) nor TLS (--tls-cert/--tls-key): any peer could submit "
                             "prefills; pass --insecure to serve anyway")
        if tls is None:
            log.warning("prefill node listens beyond loopback without TLS", listen=listen,
                        token="set (sent in clear)" if token else "none")
    limit = servicer.limits.max_call_bytes
    # so_reuseport off: a port in use fails to bind (by default gRPC would add a second listener on it)
    server = grpc.aio.server(
        interceptors=[_TokenCheck(token)] if token else None,
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", 1 << 20),
                 ("grpc.so_reuseport", 0)])
    _add_servicer(servicer, server)
    try:
        if tls is not None:
            bound = server.add_secure_port(listen, grpc.ssl_server_credentials([tls]))
        else:
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
