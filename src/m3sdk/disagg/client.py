"""The decode side's remote-prefill client: handshakes its prefill nodes, heartbeats them, and runs one job
per remotely prefilled request (post receive buffers, call Prefill, wait for both the pages and the final
message).

The engine core (a plain thread) calls `submit` and `cancel`; the jobs run on the disagg loop. Every job ends
by its deadline: on any failure (node error, transport error, a node that stops answering heartbeats, a
malformed reply) the receive is retired *before* the job's future fails (and the node is sent an Abort), so
the caller may reuse or free the pages the moment it sees the failure. The client never frees pages: the core
owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from m3sdk.disagg import loop
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb
from m3sdk.disagg._proto import m3sdk_disagg_pb2_grpc as pb_grpc
from m3sdk.disagg.compat import PROTOCOL_VERSION, CompatInfo
from m3sdk.disagg.messages import WireImage, check_reply, images_to_proto, pack_token_ids, sampling_to_proto
from m3sdk.disagg.server import TOKEN_HEADER
from m3sdk.disagg.transport import KVTransport, Receive, TransportError, build_transport
from m3sdk.disagg.wire import MAX_TRANSFER_ID, TransferPlan, WireError, long_runs
from m3sdk.errors import PrefillNodeError
from m3sdk.observability import get_logger
from m3sdk.params import SamplingParams

log = get_logger("m3sdk.disagg.client")

# Transfer ids are tags on the process's one UCX worker: unique per process, whichever client asks.
_transfer_ids = itertools.count(random.randrange(1, 1 << 32))


SLOW_BEATS = 3  # heartbeats in a row that time out before a node is taken for down


def _next_transfer_id() -> int:
    return next(_transfer_ids) % MAX_TRANSFER_ID + 1


@dataclass(frozen=True)
class RemotePrefillResult:
    first_token: int
    first_logprob: float
    top_logprobs: list[tuple[int, float]] | None  # when the request asked for top-n logprobs
    node: str
    bytes: int  # KV and index-key bytes that landed in the pages
    seconds: float  # from the call to the pages landed and the first token back (node compute and transfer overlap)


@dataclass
class _Node:
    target: str
    stub: pb_grpc.PrefillNodeStub
    channel: grpc.aio.Channel
    healthy: bool = False
    error: str = "not contacted yet"
    remote_running: int = 0
    max_prompt_tokens: int = 0  # from its handshake: a longer prompt goes elsewhere (or falls back) at once
    max_image_bytes: int = 0  # likewise for a prompt's image files (0: it takes no images)
    slow_beats: int = 0  # heartbeats in a row that timed out
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set when it stops answering; then replaced
    jobs: set[asyncio.Task] = field(default_factory=set)


class PrefillClient:
    """Remote prefill for one decode engine. `rows` are the engine's pool pages (wire.page_rows)."""

    def __init__(self, nodes: Sequence[str], compat: CompatInfo, rows: list[list[torch.Tensor]], vocab_size: int,
                 *, transport: KVTransport | None = None, token: str | None = None,
                 tls_root_certificates: bytes | None = None, layers_per_group: int | None = None,
                 max_message_bytes: int | None = None, heartbeat_s: float = 1.0, connect_timeout: float = 5.0):
        if not nodes:
            raise ValueError("prefill_nodes is empty")
        self.compat, self.rows, self.vocab_size = compat, rows, vocab_size
        self.transport = transport or build_transport()
        # groups of 4 layers (as SGLang's layer pipeline), but at least two groups, so that the first group
        # always travels while the rest of the prompt computes
        default = max(1, min(4, compat.num_layers // 2))
        self.layers_per_group = min(layers_per_group or default, compat.num_layers)
        # the cap on one data message. Staged, the decode side holds up to twice the transport's window of them (4
        # posted, 4 being placed) per transfer: 256 MiB on GPUs (host time per message, not bytes, sets the rate
        # there, so messages are large), 64 MiB on CPUs. Received in place nothing is staged, and larger messages
        # cut larger pieces (each a rendezvous of UCX's): 2 GiB, where the rate levels off (docs/perf.md has the
        # rates by message size). A 32K prompt's 4-layer group of the full model is about 155 MB (one message), a
        # 128K one's 620 MB
        self.max_message_bytes = max_message_bytes
        self._staged_bytes = 256 << 20 if rows[0][0].is_cuda else 64 << 20
        self.heartbeat_s, self.connect_timeout = heartbeat_s, connect_timeout
        self._metadata = ((TOKEN_HEADER, f"Bearer {token}"),) if token else None
        self._targets = list(nodes)
        self._tls = tls_root_certificates
        self._nodes: list[_Node] = []
        self._jobs: dict[str, asyncio.Task] = {}
        self._heartbeats: list[asyncio.Task] = []
        self._aborts: set[asyncio.Task] = set()  # sent, not awaited: referenced until done (asyncio keeps weak ones)

    # -- any thread but the disagg loop ------------------------------------------------------------------

    def start(self) -> None:
        """Open the transport and handshake every node. An incompatible node is an error now; an
        unreachable one is retried by the heartbeat (requests fall back meanwhile)."""
        loop.run(self._start())

    def close(self) -> None:
        loop.run(self._close())

    @property
    def has_healthy_node(self) -> bool:
        return any(n.healthy for n in self._nodes)

    def takes_images(self, num_bytes: int) -> bool:
        """Whether a healthy node takes a prompt's images of `num_bytes` bytes."""
        return any(n.healthy and 0 < num_bytes <= n.max_image_bytes for n in self._nodes)

    def node_states(self) -> dict[str, str]:
        return {n.target: "healthy" if n.healthy else n.error for n in self._nodes}

    def submit(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, pages: Sequence[int],
               num_cached_pages: int, timeout_s: float, images: Sequence[WireImage] = ()
               ) -> Future[RemotePrefillResult]:
        """Prefill `token_ids` (with their `images`) remotely into `pages` (the request's page table; the first
        `num_cached_pages` already hold valid K/V here and are not sent). The future fails with
        PrefillNodeError."""
        return loop.submit(self._submit(request_id, list(token_ids), params, list(pages), num_cached_pages,
                                        timeout_s, tuple(images)))

    def cancel_async(self, request_id: str) -> Future[None]:
        """Abort a job; once the future is done, its pages are no longer written. Unknown ids are a no-op."""
        return loop.submit(self._cancel(request_id))

    # -- the disagg loop ----------------------------------------------------------------------------------

    async def _start(self) -> None:
        await self.transport.start(listen=True)
        for target in self._targets:
            opts = [("grpc.max_receive_message_length", 1 << 20)]
            channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(self._tls), options=opts)
                       if self._tls is not None else grpc.aio.insecure_channel(target, options=opts))
            self._nodes.append(_Node(target, pb_grpc.PrefillNodeStub(channel), channel))
        # the first handshake waits for each node's channel to connect (up to connect_timeout): a node still coming
        # up, or a connection attempt that failed once, is not taken for down; later ones fail at once (the
        # heartbeat retries them every beat)
        await asyncio.gather(*(self._handshake(n, wait_for_ready=True) for n in self._nodes))
        self._heartbeats = [asyncio.ensure_future(self._heartbeat(n)) for n in self._nodes]

    async def _handshake(self, node: _Node, wait_for_ready: bool = False) -> None:
        request = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat=self.compat.to_proto(),
                                      transports=[self.transport.name])
        try:
            reply = await node.stub.Handshake(request, timeout=self.connect_timeout, metadata=self._metadata,
                                              wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                raise PrefillNodeError(f"prefill node {node.target} refused the handshake: {e.details()}") from e
            node.error = f"unreachable: {e.code().name}"
            return
        diff = self.compat.differences(CompatInfo.from_proto(reply.compat))
        if reply.protocol_version != PROTOCOL_VERSION or diff:
            raise PrefillNodeError(f"prefill node {node.target} is incompatible (decode != node): "
                                   + "; ".join(diff or [f"protocol {PROTOCOL_VERSION} != {reply.protocol_version}"]))
        node.max_prompt_tokens, node.max_image_bytes = reply.max_prompt_tokens, reply.max_image_bytes
        node.healthy, node.error = True, ""

    async def _heartbeat(self, node: _Node) -> None:
        # one loop per node: an unreachable node's handshake (up to connect_timeout) delays no other node's beat
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._beat(node)

    async def _beat(self, node: _Node) -> None:
        try:
            if not node.healthy:
                await self._handshake(node)
                return
            reply = await node.stub.Health(pb.HealthRequest(), timeout=self.heartbeat_s, metadata=self._metadata)
            node.remote_running, node.slow_beats = reply.running, 0
            if not reply.serving:  # draining: no new work, but what it runs still finishes (server.drain)
                log.warning("prefill node draining", node=node.target)
                node.healthy, node.error = False, "draining"
        except grpc.aio.AioRpcError as e:
            # a node that is gone refuses the connection (UNAVAILABLE) at once; one that answers late is busy (a
            # loaded host) and is given SLOW_BEATS beats before its jobs fail
            node.slow_beats += 1
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or node.slow_beats >= SLOW_BEATS:
                self._mark_down(node, f"heartbeat failed: {e.code().name}")
        except PrefillNodeError as e:  # it came back incompatible (another model): keep it out
            node.error = str(e)

    def _mark_down(self, node: _Node, why: str) -> None:
        if node.healthy:
            log.warning("prefill node down", node=node.target, why=why)
        node.healthy, node.error = False, why
        node.down.set()  # fails its jobs at once
        node.down = asyncio.Event()

    def _pick(self, num_tokens: int, image_bytes: int) -> _Node:
        healthy = [n for n in self._nodes if n.healthy]
        if not healthy:
            raise PrefillNodeError("no healthy prefill node: " + "; ".join(
                f"{n.target}: {n.error}" for n in self._nodes))
        fits = [n for n in healthy if num_tokens <= n.max_prompt_tokens]
        if not fits:
            raise PrefillNodeError(f"no prefill node takes a {num_tokens}-token prompt: " + "; ".join(
                f"{n.target}: max_prompt_tokens {n.max_prompt_tokens}" for n in healthy))
        if image_bytes:
            fits = [n for n in fits if image_bytes <= n.max_image_bytes]
            if not fits:
                raise PrefillNodeError(f"no prefill node takes images of {image_bytes} bytes: " + "; ".join(
                    f"{n.target}: max_image_bytes {n.max_image_bytes}"
                    + (" (no vision encoder)" if not n.max_image_bytes else "") for n in healthy))
        return min(fits, key=lambda n: (len(n.jobs) + n.remote_running, len(n.jobs)))

    async def _submit(self, request_id: str, token_ids: list[int], params: SamplingParams, pages: list[int],
                      num_cached_pages: int, timeout_s: float, images: tuple[WireImage, ...]) -> RemotePrefillResult:
        node = self._pick(len(token_ids), sum(len(i.data) for i in images))
        task = asyncio.current_task()
        self._jobs[request_id] = task
        node.jobs.add(task)
        try:
            return await self._job(node, request_id, token_ids, params, pages, num_cached_pages, timeout_s, images)
        finally:
            node.jobs.discard(task)
            if self._jobs.get(request_id) is task:
                del self._jobs[request_id]

    async def _job(self, node: _Node, request_id: str, token_ids: list[int], params: SamplingParams,
                   pages: list[int], num_cached_pages: int, timeout_s: float, images: tuple[WireImage, ...]
                   ) -> RemotePrefillResult:
        start = time.monotonic()
        deadline = start + timeout_s
        send_pages = pages[num_cached_pages:]
        # a plan of pieces where the transport receives in place and the pages form runs; staged otherwise
        pieces = self.transport.in_place and long_runs(send_pages) is not None
        message_bytes = self.max_message_bytes or (1 << 31 if pieces else self._staged_bytes)
        plan = TransferPlan.build(self.rows, _next_transfer_id(), len(send_pages), self.layers_per_group,
                                  message_bytes, send_pages, pieces)
        # the node sees several engines' requests: the transfer id makes ours unique there
        node_id = re.sub(r"[^\x21-\x7e]", "_", f"{plan.transfer_id:x}.{request_id}")[:128]
        try:  # before anything is posted: nothing to retire when a value does not fit the wire
            request = pb.PrefillRequest(
                request_id=node_id, compat_hash=self.compat.digest, token_ids=pack_token_ids(token_ids),
                sampling=sampling_to_proto(params), transport_port=self.transport.port,
                transfer_id=plan.transfer_id, num_cached_pages=num_cached_pages, dst_pages=send_pages,
                layers_per_group=self.layers_per_group, max_message_bytes=message_bytes,
                deadline_unix_s=time.time() + timeout_s, message_per_piece=plan.pieces,
                images=images_to_proto(images))
        except ValueError as e:  # e.g. a seed outside uint64
            raise PrefillNodeError(f"request {request_id!r} cannot be sent to a prefill node: {e}") from e
        call = node.stub.Prefill(request, timeout=timeout_s, metadata=self._metadata)
        receive: Receive | None = None
        waits: set[asyncio.Future] = set()
        down = asyncio.ensure_future(node.down.wait())
        ok = False
        try:
            # the call leaves first (grpc's task runs now), then this side posts its receives while the node admits
            # the prompt: UCX holds a message that comes before its receive (an unexpected message) until it is
            # posted, so posting need not come first, and posting (milliseconds for a large transfer) overlaps the
            # call's trip
            await asyncio.sleep(0)
            dst = torch.tensor(send_pages, dtype=torch.int64, device=self.rows[0][0].device)
            receive = self.transport.receive(plan, self.rows, dst)
            waits = {asyncio.ensure_future(call), asyncio.ensure_future(receive.wait())}
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending | {down}, timeout=deadline - time.monotonic(),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise PrefillNodeError(f"remote prefill on {node.target} passed its {timeout_s:.1f} s deadline")
                if down in done:
                    raise PrefillNodeError(f"prefill node {node.target} went down: {node.error}")
                pending.discard(down)
                for t in done:
                    t.result()
            reply = await call
            check_reply(reply, self.vocab_size, len(token_ids), plan.num_pages, len(plan.messages),
                        plan.total_bytes, params.logprobs or 0)
            ok = True
            top = None if params.logprobs is None else [(t.token_id, t.logprob) for t in reply.top_logprobs]
            return RemotePrefillResult(reply.first_token, reply.first_logprob, top, node.target, plan.total_bytes,
                                       time.monotonic() - start)
        except grpc.aio.AioRpcError as e:
            raise PrefillNodeError(f"prefill node {node.target}: {e.code().name}: {e.details()}") from e
        except (TransportError, WireError) as e:
            raise PrefillNodeError(f"remote prefill from {node.target} failed: {e}") from e
        finally:
            down.cancel()
            if not ok:
                call.cancel()
                if receive is not None:
                    await receive.cancel()
                for t in waits:
                    t.cancel()
                abort = asyncio.ensure_future(self._abort(node, node_id))
                self._aborts.add(abort)
                abort.add_done_callback(self._aborts.discard)

    async def _abort(self, node: _Node, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await node.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.connect_timeout,
                                  metadata=self._metadata)

    async def _cancel(self, request_id: str) -> None:
        task = self._jobs.get(request_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _close(self) -> None:
        for beat in self._heartbeats:
            beat.cancel()
        for task in list(self._jobs.values()):
            task.cancel()
        await asyncio.gather(*self._jobs.values(), return_exceptions=True)
        await asyncio.gather(*self._aborts, return_exceptions=True)  # each bounded by connect_timeout
        for node in self._nodes:
            await node.channel.close()
        await self.transport.close()
