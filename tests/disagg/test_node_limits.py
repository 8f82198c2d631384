"""The prefill node as an adversary meets it (real node processes on loopback): limits reported by Handshake and
enforced (in-flight orders, deadlines cut to the node's, a receiver that does not read), errors bounded in size,
Abort scoped to the caller, no listening beyond loopback without a token or TLS, and on the real engine: a prompt
its KV cache cannot hold refused at once (the decode side falls back), a dead engine reported by Health and
ending the node process."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

pytest.importorskip("ucxx")

from disagg_helpers import TOKEN, VOCAB, PatternBackend, compat, spawn_engine_node, spawn_node, stop_node  # noqa: E402

from m3sdk import Engine  # noqa: E402
from m3sdk.disagg import loop  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.disagg._proto.m3sdk_disagg_pb2_grpc import PrefillNodeStub  # noqa: E402
from m3sdk.disagg.compat import PROTOCOL_VERSION, CompatInfo, model_fingerprint  # noqa: E402
from m3sdk.disagg.messages import Limits, check_prefill, pack_token_ids, sampling_to_proto  # noqa: E402
from m3sdk.disagg.server import MAX_DETAILS  # noqa: E402
from m3sdk.disagg.wire import WireError  # noqa: E402
from m3sdk.node import PrefillNode  # noqa: E402
from m3sdk.params import SamplingParams  # noqa: E402

AUTH = (("authorization", f"Bearer {TOKEN}"),)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_request(request_id: str, tokens: list[int], port: int, deadline_s: float = 60.0,
                    digest: str | None = None) -> pb.PrefillRequest:
    pages = -(-len(tokens) // 16)
    return pb.PrefillRequest(request_id=request_id, compat_hash=digest or compat().digest,
                             token_ids=pack_token_ids(tokens), transport_port=port, transfer_id=7,
                             sampling=sampling_to_proto(SamplingParams(temperature=0.0)),
                             dst_pages=list(range(pages)), layers_per_group=1, max_message_bytes=1 << 20,
                             deadline_unix_s=time.time() + deadline_s)


async def call(address: str, method: str, request, timeout: float = 30.0):
    """(status, details, reply) of one call."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await getattr(PrefillNodeStub(channel), method)(request, timeout=timeout, metadata=AUTH)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), None
        return grpc.StatusCode.OK, "", reply


def run(coro):
    return loop.run(coro, timeout=120)


@pytest.fixture(scope="module")
def quick_node():
    proc, address = spawn_node(receiver_timeout_s=1.0, max_in_flight=5, max_deadline_s=30.0)
    yield address
    stop_node(proc)


@pytest.fixture(scope="module")
def idle_port():
    """A KV transport port that listens and never posts a receive."""
    from m3sdk.disagg.transport import build_transport

    transport = build_transport()
    run(transport.start(listen=True))
    yield transport.port
    run(transport.close())


@pytest.fixture(scope="module")
def slow_node():
    # dual-stack: callers from 127.0.0.1 and from ::1 are different callers
    proc, address = spawn_node(delay_s=2.0, listen="[::]:0", max_in_flight=2, max_deadline_s=1.0)
    yield address.rpartition(":")[2]
    stop_node(proc)


def test_handshake_reports_the_limits_and_errors_stay_small(quick_node):
    hello = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat=compat().to_proto(), transports=["ucx"])
    status, _, reply = run(call(quick_node, "Handshake", hello))
    assert status == grpc.StatusCode.OK
    assert (reply.max_prompt_tokens, reply.max_in_flight, reply.max_deadline_s, reply.receiver_timeout_s) == \
        (4096, 5, 30.0, 1.0)
    assert reply.max_image_bytes == 0  # its backend has no vision encoder
    # a field the refusal quotes, far larger than gRPC's metadata allows: the status still arrives, cut
    huge = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat=compat().to_proto(),
                               transports=["x" * 90_000])
    status, details, _ = run(call(quick_node, "Handshake", huge))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "transport" in details
    assert len(details.encode()) <= MAX_DETAILS


def test_image_spans_and_bytes_are_checked_before_anything_runs():
    tokens = [5] * 20 + [250] * 20 + [6] * 10
    image = dict(offset=20, num_tokens=20, digest=bytes(16), data=b"x" * 100)

    def check(max_image_bytes: int = 1000, **changes):
        request = prefill_request("img", tokens, 1000)
        request.images.append(pb.PromptImage(**{**image, **changes}))
        return check_prefill(request, Limits(max_prompt_tokens=4096, max_image_bytes=max_image_bytes),
                             compat().digest, VOCAB, 4)

    (got,) = check().images
    assert (got.offset, got.num_tokens, got.data) == (20, 20, b"x" * 100)
    for limit, changes, match in [(0, {}, "takes no images"), (99, {}, "max_image_bytes of 99"),
                                  (1000, dict(offset=40, num_tokens=11), "within the 50-token prompt"),
                                  (1000, dict(num_tokens=0), "within"), (1000, dict(digest=b"short"), "digest"),
                                  (1000, dict(data=b""), "digest")]:
        with pytest.raises(WireError, match=match):
            check(limit, **changes)
    two = prefill_request("img", tokens, 1000)
    two.images.extend([pb.PromptImage(**image), pb.PromptImage(**{**image, "offset": 30})])  # overlapping spans
    with pytest.raises(WireError, match="apart"):
        check_prefill(two, Limits(max_image_bytes=1000), compat().digest, VOCAB, 4)
    # a node's calls may carry its image bytes: gRPC's size cap grows with them
    assert Limits(max_image_bytes=0).max_call_bytes < Limits().max_call_bytes - Limits().max_image_bytes


def test_a_receiver_that_does_not_read_frees_the_slot_within_receiver_timeout(quick_node, idle_port):
    # 250 pages: messages large enough for UCX's rendezvous, which waits for a receive nobody posts
    t0 = time.monotonic()
    status, details, _ = run(call(quick_node, "Prefill", prefill_request("unread", [i % 999 + 1 for i in range(4000)],
                                                                         idle_port)))
    assert status == grpc.StatusCode.UNAVAILABLE and "receiver_timeout_s" in details, details
    assert time.monotonic() - t0 < 8.0  # the caller's deadline was 60 s
    status, _, health = run(call(quick_node, "Health", pb.HealthRequest()))
    assert status == grpc.StatusCode.OK and health.running == 0 and health.serving


def test_deadlines_are_cut_in_flight_is_capped_and_abort_is_the_callers_own(slow_node, idle_port):
    port = slow_node
    v4, v6 = f"127.0.0.1:{port}", f"[::1]:{port}"

    async def scenario():
        t0 = time.monotonic()
        first = asyncio.ensure_future(call(v4, "Prefill", prefill_request("mine", list(range(1, 40)),
                                                                         idle_port, 60)))
        second = asyncio.ensure_future(call(v4, "Prefill", prefill_request("two", list(range(1, 40)),
                                                                          idle_port, 60)))
        await asyncio.sleep(0.3)
        third = await call(v4, "Prefill", prefill_request("three", list(range(1, 40)), idle_port, 60))
        other = await call(v6, "Abort", pb.AbortRequest(request_id="mine"))  # another caller: nothing happens
        health = await call(v6, "Health", pb.HealthRequest())
        results = await asyncio.gather(first, second)
        return third, other, health, results, time.monotonic() - t0

    third, other, health, (first, second), took = run(scenario())
    assert third[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_in_flight of 2" in third[1]
    assert other[0] == grpc.StatusCode.OK and not other[2].was_running
    assert health[2].running == 2
    # both ran into the node's max_deadline_s (1 s), not the callers' 60 s (nor were they aborted)
    assert first[0] == second[0] == grpc.StatusCode.DEADLINE_EXCEEDED, (first, second)
    assert took < 5.0

    async def own_abort():
        job = asyncio.ensure_future(call(v4, "Prefill", prefill_request("mine2", list(range(1, 40)),
                                                                        idle_port, 60)))
        await asyncio.sleep(0.3)
        mine = await call(v4, "Abort", pb.AbortRequest(request_id="mine2"))
        return mine, await job

    mine, job = run(own_abort())
    assert mine[2].was_running and job[0] == grpc.StatusCode.ABORTED


def test_no_listening_beyond_loopback_without_a_token_or_tls():
    backend = PatternBackend("bf16", "plain")
    with pytest.raises(ValueError, match="beyond loopback"):
        PrefillNode(backend, "0.0.0.0:0").start()
    node = PrefillNode(backend, "0.0.0.0:0", insecure=True).start()
    node.stop(0.0)
    node = PrefillNode(backend, "0.0.0.0:0", token=TOKEN).start()
    node.stop(0.0)


FAIL_AT = 77  # prompt tokens that kill the node's engine


@pytest.fixture(scope="module")
def small_engine_node(engine_checkpoint):
    # 300 KB of KV cache: max_model_len 256, so prompts up to 255 tokens
    proc, address = spawn_engine_node(engine_checkpoint, fail_at_tokens=FAIL_AT, kv_cache_memory=300_000)
    yield proc, address
    stop_node(proc)


async def test_the_engine_node_refuses_what_its_cache_cannot_hold_and_stops_once_its_engine_died(
        engine_checkpoint, small_engine_node):
    proc, address = small_engine_node
    async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20) as engine:
        long, short = [(7 * i) % 251 + 1 for i in range(300)], [(5 * i) % 251 + 1 for i in range(100)]
        local = [(await engine.generate(p, temperature=0.0, max_tokens=4)).token_ids for p in (long, short)]
        digest = CompatInfo.from_spec(engine._core.cache.kv.spec, model_fingerprint(engine_checkpoint)).digest
    status, details, _ = run(call(address, "Prefill", prefill_request("big", long, closed_port(), digest=digest)))
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens" in details and "255" in details
    async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20, prefill_nodes=[address],
                      remote_prefill_min_tokens=32) as engine:
        client = engine._admission.client
        assert client._nodes[0].max_prompt_tokens == 255
        t0 = time.monotonic()
        assert (await engine.generate(long, temperature=0.0, max_tokens=4)).token_ids == local[0]
        assert time.monotonic() - t0 < 5.0 and engine._admission.num_fallbacks == 1
        assert (await engine.generate(short, temperature=0.0, max_tokens=4)).token_ids == local[1]
        assert engine._admission.num_remote == 1
        # a fault kills the node's engine: this request falls back, Health says so, the node process ends
        doomed = [(3 * i) % 251 + 1 for i in range(FAIL_AT)]
        assert len((await engine.generate(doomed, temperature=0.0, max_tokens=4)).token_ids) == 4
    status, _, health = run(call(address, "Health", pb.HealthRequest()))
    if status == grpc.StatusCode.OK:  # it may be gone already
        assert not health.serving and "injected fault" in health.error
    proc.join(10)
    assert proc.exitcode not in (None, 0)
