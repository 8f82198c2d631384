"""A protobuf fuzzer over every method of a prefill node (a real node process serving a page pattern): random bytes
and field-by-field variations of well-formed calls get a status from a known set, never UNKNOWN or INTERNAL, with
details within MAX_DETAILS; the node answers Health and holds nothing afterwards."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("ucxx")
sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))

from disagg_helpers import TOKEN, compat, spawn_node, stop_node  # noqa: E402

from m3sdk.disagg import loop  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.disagg.compat import PROTOCOL_VERSION  # noqa: E402
from m3sdk.disagg.server import MAX_DETAILS  # noqa: E402

FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.ALREADY_EXISTS}
METHODS = ("Handshake", "Prefill", "Abort", "Health")
u32, i32 = st.integers(0, 2**32 - 1), st.integers(-2**31, 2**31 - 1)
u64 = st.integers(0, 2**64 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)
short = st.text(max_size=12)


@pytest.fixture(scope="module")
def node():
    proc, address = spawn_node(receiver_timeout_s=0.5, max_deadline_s=1.0)
    tally: dict[str, int] = {}
    yield address, tally
    print(f"\nfuzzed node calls by status: {tally}")
    stop_node(proc)


def _call(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            rpc = channel.unary_unary(f"/m3sdk.disagg.v1.PrefillNode/{method}")
            try:
                await rpc(payload, timeout=20, metadata=(("authorization", f"Bearer {TOKEN}"),))
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
            return grpc.StatusCode.OK, ""
    return loop.run(call(), timeout=60)


def _check(node, method: str, payload: bytes) -> None:
    address, tally = node
    code, details = _call(address, method, payload)
    tally[code.name] = tally.get(code.name, 0) + 1
    assert code in EXPECTED, (method, code, details[:200])
    assert len(details.encode()) <= MAX_DETAILS


@FUZZ
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=300))
def test_random_bytes_on_every_method(node, method, payload):
    _check(node, method, payload)


sampling = st.builds(pb.SamplingParams, temperature=doubles, top_p=doubles, top_k=i32, min_p=doubles,
                     repetition_penalty=doubles, has_seed=st.booleans(), seed=u64, top_logprobs=u32)


@FUZZ
@given(request_id=st.one_of(st.just("f1"), short), tokens=st.lists(i32, min_size=0, max_size=40),
       sampling=st.one_of(st.none(), sampling), num_cached_pages=st.one_of(st.just(0), u32),
       dst_pages=st.one_of(st.none(), st.lists(i32, max_size=5)), layers_per_group=st.one_of(st.just(1), u32),
       max_message_bytes=st.one_of(st.just(1 << 20), u32), transfer_id=st.one_of(st.just(9), u64),
       transport_port=st.one_of(st.just(1), u32), deadline=st.one_of(st.just(0.5), doubles),
       pieces=st.booleans(), good_hash=st.booleans())
def test_variations_of_a_prefill_call(node, request_id, tokens, sampling, num_cached_pages, dst_pages,
                                      layers_per_group, max_message_bytes, transfer_id, transport_port, deadline,
                                      pieces, good_hash):
    from m3sdk.disagg.messages import pack_token_ids

    pages = -(-len(tokens) // 16)
    request = pb.PrefillRequest(
        request_id=request_id, compat_hash=compat().digest if good_hash else "x", token_ids=pack_token_ids(tokens),
        sampling=sampling, num_cached_pages=num_cached_pages,
        dst_pages=list(range(pages)) if dst_pages is None else dst_pages, layers_per_group=layers_per_group,
        max_message_bytes=max_message_bytes, transfer_id=transfer_id, transport_port=transport_port,
        deadline_unix_s=time.time() + deadline if deadline == 0.5 else deadline, message_per_piece=pieces)
    _check(node, "Prefill", request.SerializeToString())


@FUZZ
@given(version=st.one_of(st.just(PROTOCOL_VERSION), u32), transports=st.lists(short, max_size=3),
       layers=st.one_of(st.just(None), u32), request_id=short)
def test_variations_of_handshake_and_abort(node, version, transports, layers, request_id):
    info = compat().to_proto()
    if layers is not None:
        info.num_layers = layers
    _check(node, "Handshake", pb.HandshakeRequest(protocol_version=version, compat=info,
                                                  transports=transports).SerializeToString())
    _check(node, "Abort", pb.AbortRequest(request_id=request_id).SerializeToString())


def test_the_fuzzed_node_still_answers_and_holds_nothing(node):
    address, _ = node

    async def health():
        from m3sdk.disagg._proto.m3sdk_disagg_pb2_grpc import PrefillNodeStub

        async with grpc.aio.insecure_channel(address) as channel:
            return await PrefillNodeStub(channel).Health(pb.HealthRequest(), timeout=10,
                                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
    deadline = time.monotonic() + 10
    while (reply := loop.run(health(), timeout=30)).running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reply.serving and reply.running == 0
