"""Remote prefill protocol and UCX transport between real processes on 127.0.0.1 (a node process serving a
page pattern; the decode side is this process with a real KVPool)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest
import torch

pytest.importorskip("ucxx")

from disagg_helpers import (  # noqa: E402
    TOKEN,
    VOCAB,
    PatternBackend,
    compat,
    expected_rows,
    first_token,
    spawn_node,
    spec,
    stop_node,
)

from m3sdk.cache.kv_pool import KVPool  # noqa: E402
from m3sdk.disagg import loop, wire  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.disagg.client import PrefillClient  # noqa: E402
from m3sdk.disagg.messages import pack_token_ids  # noqa: E402
from m3sdk.disagg.transport import TransportError  # noqa: E402
from m3sdk.errors import PrefillNodeError  # noqa: E402
from m3sdk.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def node():
    proc, address = spawn_node("bf16", "plain", delay_s=0.0)
    yield address
    stop_node(proc)


@pytest.fixture(scope="module")
def slow_node():
    proc, address = spawn_node("bf16", "plain", delay_s=3.0)
    yield proc, address
    stop_node(proc)


def make_client(address: str, kv_dtype: str = "bf16", layout: str = "plain", token: str | None = TOKEN,
                **kwargs) -> tuple[PrefillClient, KVPool]:
    pool = KVPool(spec(kv_dtype, layout))
    client = PrefillClient([address], compat(kv_dtype, layout), wire.page_rows(pool), VOCAB, token=token,
                           **kwargs)
    client.start()
    return client, pool


def assert_pages(pool: KVPool, tokens: list[int], pages: list[int], num_cached: int) -> None:
    want = expected_rows(pool.spec, tokens, num_cached)
    sent = torch.tensor(pages[num_cached:])
    untouched = torch.tensor(sorted(set(range(pool.spec.num_pages)) - set(sent.tolist())))
    for got_layer, want_layer in zip(wire.page_rows(pool), want, strict=True):
        for got, expected in zip(got_layer, want_layer, strict=True):
            assert torch.equal(got[sent], expected)
            assert not got[untouched].any(), "a page outside the transfer was written"


@pytest.mark.parametrize("pieces", [False, True])
def test_pages_arrive_intact_in_their_pages(node, pieces):
    # 300 tokens = 19 pages over 4 layers; 64 KiB messages force several messages per layer group. `pieces`: the
    # decode side receives in place (the default), asking for plans of pieces where its pages form runs
    from m3sdk.disagg.ucx_transport import UcxTransport

    transport = UcxTransport(in_place=pieces)
    client, pool = make_client(node, layers_per_group=2, max_message_bytes=64 << 10, transport=transport)
    try:
        tokens = [(i * 37) % VOCAB for i in range(300)]
        pages = [60, 3, 17, 4, 5, 40, 41, 2, 9, 10, 11, 30, 31, 32, 33, 50, 51, 0, 63]
        result = client.submit("r1", tokens, GREEDY, pages, num_cached_pages=0, timeout_s=30).result(30)
        assert (result.first_token, result.first_logprob) == (first_token(tokens), -0.25)
        assert_pages(pool, tokens, pages, 0)
        # a prefix the decode side holds (3 pages) is not sent: those pages stay as they were (zero)
        pool2_tokens = [(i * 11) % VOCAB for i in range(100)]
        pages2 = [20, 21, 22, 23, 24, 25, 26]
        for t in (t for layer in wire.page_rows(pool) for t in layer):
            t.zero_()
        client.submit("r2", pool2_tokens, GREEDY, pages2, num_cached_pages=3, timeout_s=30).result(30)
        assert_pages(pool, pool2_tokens, pages2, 3)
        # pages in long runs (a fresh engine's): each message scattered as runs (one _foreach_copy_); the 64 KiB
        # cut makes messages whose pages straddle the two runs
        tokens3 = [(i * 13) % VOCAB for i in range(400)]
        pages3 = list(range(30, 46)) + list(range(5, 14))
        assert wire.TransferPlan.build(wire.page_rows(pool), 1, 25, 2, 64 << 10, pages3).runs is not None
        for t in (t for layer in wire.page_rows(pool) for t in layer):
            t.zero_()
        received = transport.receive
        plans = []
        transport.receive = lambda plan, *args: plans.append(plan) or received(plan, *args)
        client.submit("r3", tokens3, GREEDY, pages3, num_cached_pages=0, timeout_s=30).result(30)
        assert_pages(pool, tokens3, pages3, 0)
        assert [p.pieces for p in plans] == [pieces]
    finally:
        client.close()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_pack_and_scatter_put_each_page_where_the_plan_says(kv_dtype):
    """wire alone, every way pages move: runs of pages (contiguous pieces, one _foreach_copy_ per message on a CPU)
    or by index, on each side, with messages cut inside a run; pages outside the transfer stay untouched."""
    src_pool, dst_pool = KVPool(spec(kv_dtype)), KVPool(spec(kv_dtype))
    src_rows, dst_rows = wire.page_rows(src_pool), wire.page_rows(dst_pool)
    gen = torch.Generator().manual_seed(3)
    for t in (t for layer in src_rows for t in layer):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    runs = list(range(30, 46)) + list(range(5, 14))
    scattered = torch.randperm(64, generator=gen)[:25].tolist()
    for src, dst in ((runs, runs), (scattered, runs), (runs, scattered), (scattered, scattered)):
        for t in (t for layer in dst_rows for t in layer):
            t.zero_()
        plan = wire.TransferPlan.build(dst_rows, 7, 25, 2, 64 << 10, dst)
        assert (plan.runs is not None) == (dst is runs) and len(plan.messages) == 4
        packing, placing = wire.Layout(plan, src_rows, torch.tensor(src)), wire.Layout(plan, dst_rows,
                                                                                        torch.tensor(dst), plan.runs)
        assert (packing.runs is not None) == (src is runs) and (placing.runs is not None) == (dst is runs)
        for msg in plan.messages:
            buf = torch.empty(msg.nbytes, dtype=torch.uint8)
            wire.pack(plan, msg, packing, buf, wire.frames(plan, "cpu"))
            wire.scatter(plan, msg, placing, buf)
        untouched = sorted(set(range(64)) - set(dst))
        for src_layer, dst_layer in zip(src_rows, dst_rows, strict=True):
            for a, b in zip(src_layer, dst_layer, strict=True):
                assert torch.equal(b[dst], a[src]) and not b[untouched].any()


def test_host_and_device_pools_share_one_plan_and_an_older_wire_version_is_refused():
    """One path on CPUs and GPUs (meta rows stand in for a GPU pool): the same messages and runs, one UCX message
    each. A wire-3 peer (it sent host-memory messages as header, parts, trailer) fails at the header check."""
    def rows(device: str) -> list[list[torch.Tensor]]:
        return [[torch.zeros(64, w, dtype=torch.uint8, device=device) for w in widths]
                for widths in ((4096, 4096, 128), (4096, 4096, 128, 1024))]

    pages = list(range(8, 40))
    host = wire.TransferPlan.build(rows("cpu"), 9, 32, 2, 64 << 10, pages)
    assert host == wire.TransferPlan.build(rows("meta"), 9, 32, 2, 64 << 10, pages)
    assert host.runs == ((0, 8, 32),) and len(host.messages) == 11  # 3 pages of both layers per 64 KiB
    msg = host.messages[1]
    buf = torch.empty(msg.nbytes, dtype=torch.uint8)
    wire.pack(host, msg, wire.Layout(host, rows("cpu"), torch.tensor(pages)), buf, wire.frames(host, "cpu"))
    wire.check(host, [msg], [buf])
    buf[4:6] = torch.tensor([3, 0], dtype=torch.uint8)  # the version field, little-endian
    with pytest.raises(wire.WireError, match=r"version=3 \(expected 4\)"):
        wire.check(host, [msg], [buf])


def test_fp8_shuffle_pages_and_scales_travel():
    proc, address = spawn_node("fp8", "shuffle")
    try:
        client, pool = make_client(address, "fp8", "shuffle")
        try:
            tokens = list(range(1, 41))
            pages = [7, 8, 9]
            client.submit("f1", tokens, GREEDY, pages, 0, 30).result(30)
            assert_pages(pool, tokens, pages, 0)
            assert pool.k_scale[0] is not None and pool.k_scale[0][8].any()
        finally:
            client.close()
    finally:
        stop_node(proc)


def test_handshake_mismatch_is_refused_with_the_difference(node):
    pool = KVPool(spec("fp32"))
    client = PrefillClient([node], compat("fp32"), wire.page_rows(pool), VOCAB, token=TOKEN)
    with pytest.raises(PrefillNodeError, match=r"kv_dtype: 'bf16' != 'fp32'"):
        client.start()
    client.close()
    other_model = PrefillClient([node], compat().__class__(**{**compat().__dict__, "model_fingerprint": "x"}),
                                wire.page_rows(KVPool(spec())), VOCAB, token=TOKEN)
    with pytest.raises(PrefillNodeError, match="model_fingerprint"):
        other_model.start()
    other_model.close()


def _raw(address: str, method: str, payload: bytes, token: str | None = TOKEN) -> grpc.StatusCode:
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            rpc = channel.unary_unary(f"/m3sdk.disagg.v1.PrefillNode/{method}")
            md = (("authorization", f"Bearer {token}"),) if token else None
            try:
                await rpc(payload, timeout=10, metadata=md)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK
    return loop.run(call())


def test_malformed_oversized_and_unauthenticated_calls_are_refused_and_the_node_keeps_serving(node):
    good = pb.PrefillRequest(request_id="ok", compat_hash=compat().digest, token_ids=pack_token_ids([1, 2, 3]),
                             transport_port=1, transfer_id=5, dst_pages=[0], layers_per_group=1,
                             max_message_bytes=1 << 20, deadline_unix_s=time.time() + 60)

    def variant(**changes) -> bytes:
        msg = pb.PrefillRequest()
        msg.CopyFrom(good)
        for k, v in changes.items():
            if isinstance(v, list):
                getattr(msg, k)[:] = v
            else:
                setattr(msg, k, v)
        return msg.SerializeToString()

    # not protobuf at all, on every method
    for method in ("Handshake", "Prefill", "Abort", "Health"):
        assert _raw(node, method, b"\xff\xff\xff\x0f garbage") == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw(node, "Prefill", variant(token_ids=pack_token_ids([1] * 200_000))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    invalid = [variant(token_ids=pack_token_ids([VOCAB])), variant(token_ids=pack_token_ids([-1])),
               variant(token_ids=b"\x01\x00\x00\x00\x02"), variant(dst_pages=[-3]),
               variant(dst_pages=[1, 2]), variant(num_cached_pages=1), variant(compat_hash="0" * 64),
               variant(request_id="has space"), variant(layers_per_group=99), variant(max_message_bytes=10),
               variant(max_message_bytes=(1 << 31) + 1), variant(deadline_unix_s=time.time() - 1),
               variant(transfer_id=0), variant(transport_port=70000)]
    for payload in invalid:
        assert _raw(node, "Prefill", payload) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw(node, "Health", b"", token="wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert _raw(node, "Health", b"", token=None) == grpc.StatusCode.UNAUTHENTICATED
    # still serving: a real prefill goes through
    client, pool = make_client(node)
    try:
        tokens = list(range(5, 25))
        client.submit("after", tokens, GREEDY, [1, 2], 0, 30).result(30)
        assert_pages(pool, tokens, [1, 2], 0)
    finally:
        client.close()


def test_a_second_node_on_a_port_in_use_is_refused_and_the_first_keeps_serving(node):
    from m3sdk.node import PrefillNode

    second = PrefillNode(PatternBackend("bf16", "plain"), node)
    with pytest.raises(OSError, match="the port is in use"):
        second.start()
    client, pool = make_client(node)
    try:
        tokens = list(range(30, 50))
        client.submit("still-first", tokens, GREEDY, [1, 2], 0, 30).result(30)
        assert_pages(pool, tokens, [1, 2], 0)
    finally:
        client.close()


@pytest.mark.parametrize("num_pages", [4, 16])
@pytest.mark.parametrize("layers,forged_layers", [(2, 1), (1, 2)])
def test_a_message_that_does_not_match_the_plan_never_reaches_the_pages(num_pages, layers, forged_layers):
    """A message cut short (half the layers the receiver expects) or too long (twice: UCX truncates it) is refused,
    and no page keeps anything of it, whether the pages are placed by index (4: staged) or received in place as a
    run (16: a plan of pieces, one UCX message per piece)."""
    from m3sdk.disagg.ucx_transport import UcxTransport

    pool = KVPool(spec())
    rows = wire.page_rows(pool)
    sender_rows = expected_rows(pool.spec, list(range(16 * num_pages)), 0)
    receiver, sender = UcxTransport(), UcxTransport(drain_timeout=0.5)
    dst = list(range(10, 10 + num_pages))

    async def run():
        await receiver.start(listen=True)
        await sender.start(listen=False)
        plan = wire.TransferPlan.build(rows, 1234, num_pages, layers, 1 << 20, dst, pieces=True)
        receive = receiver.receive(plan, rows, torch.tensor(dst))
        # the same transfer id and tags, cut differently: another number of layers per message
        forged = wire.TransferPlan.build(sender_rows, 1234, num_pages, forged_layers, 1 << 20, dst, pieces=True)
        outbox = sender.outbox(forged, torch.device("cpu"))
        outbox.pack(list(forged.messages), sender_rows, torch.arange(num_pages))
        push = asyncio.ensure_future(sender.push("127.0.0.1", receiver.port, outbox))
        with pytest.raises(TransportError, match="bad header|runcat|cut short"):
            await asyncio.wait_for(receive.wait(), 10)
        push.cancel()  # its later messages match no posted buffer: they can only time out
        with contextlib.suppress(asyncio.CancelledError, TransportError):
            await push

    loop.run(run(), timeout=30)
    assert not any(t.any() for layer in rows for t in layer)
    loop.run(receiver.close())
    loop.run(sender.close())


def test_abort_reaches_the_node_and_the_receive_is_retired(slow_node):
    _, address = slow_node
    client, pool = make_client(address)
    try:
        fut = client.submit("a1", list(range(40)), GREEDY, [4, 5, 6], 0, 30)
        time.sleep(0.5)
        assert _health(address).running == 1
        client.cancel_async("a1").result(10)
        assert fut.cancelled()
        deadline = time.monotonic() + 5
        while _health(address).running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _health(address).running == 0
        assert not any(t.any() for layer in wire.page_rows(pool) for t in layer)
    finally:
        client.close()


def test_deadline_fails_the_request_on_time(slow_node):
    _, address = slow_node
    client, _ = make_client(address)
    try:
        t0 = time.monotonic()
        with pytest.raises(PrefillNodeError, match="deadline|DEADLINE"):
            client.submit("d1", list(range(40)), GREEDY, [4, 5, 6], 0, 1.0).result(10)
        assert time.monotonic() - t0 < 2.5
    finally:
        client.close()


def test_node_killed_mid_prefill_fails_its_requests_at_once():
    proc, address = spawn_node(delay_s=5.0)
    client, _ = make_client(address, heartbeat_s=0.5)
    try:
        futs = [client.submit(f"k{i}", list(range(40)), GREEDY, [i * 3, i * 3 + 1, i * 3 + 2], 0, 60)
                for i in range(3)]
        time.sleep(0.5)
        proc.kill()
        t0 = time.monotonic()
        for f in futs:
            with pytest.raises(PrefillNodeError):
                f.result(10)
        assert time.monotonic() - t0 < 3.0  # far inside the 60 s deadline
        time.sleep(1.0)
        assert not client.has_healthy_node
    finally:
        client.close()
        stop_node(proc)


def _health(address: str) -> pb.HealthReply:
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            from m3sdk.disagg._proto.m3sdk_disagg_pb2_grpc import PrefillNodeStub

            return await PrefillNodeStub(channel).Health(pb.HealthRequest(), timeout=5,
                                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
    return loop.run(call())


def test_a_draining_node_finishes_the_prefills_it_runs():
    # SIGTERM drains the node: running prefills finish within its grace period (2 s), so the client must stop
    # sending it new work but must not fail the jobs it already runs there
    proc, address = spawn_node(delay_s=1.5)
    client, pool = make_client(address, heartbeat_s=0.2)
    try:
        tokens = list(range(40))
        fut = client.submit("g1", tokens, GREEDY, [7, 8, 9], 0, 30)
        time.sleep(0.3)
        proc.terminate()
        assert fut.result(10).first_token == first_token(tokens)
        assert_pages(pool, tokens, [7, 8, 9], 0)
        assert not client.has_healthy_node
    finally:
        client.close()
        stop_node(proc)


def test_a_request_the_wire_cannot_carry_fails_without_leaving_its_receive_posted(node):
    # a value the wire cannot carry (SamplingParams refuses a seed outside uint64; forced in here) must fail the
    # job as PrefillNodeError (the core then prefills locally) and must not leave receive buffers posted for a
    # transfer that never comes
    client, _ = make_client(node)
    unwired = SamplingParams()
    object.__setattr__(unwired, "seed", -1)

    async def receives() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "UcxReceive._run"]

    try:
        with pytest.raises(PrefillNodeError, match="seed|out of range"):
            client.submit("w1", list(range(40)), unwired, [1, 2, 3], 0, 10).result(10)
        assert not loop.run(receives())
    finally:
        client.close()


def test_pages_sent_in_place_are_released_once_sent_or_when_the_push_is_dropped():
    """A node sends pages in runs straight from its pool (a plan of pieces): it may reuse them only once
    `wait_released` says no send reads them. Sent: released, and the decode side got
    every byte. Not received within the bound (the decode side posted nothing for the transfer): the push's
    endpoint is dropped, the push fails, and the pages are released all the same."""
    from m3sdk.disagg.ucx_transport import UcxTransport

    pool = KVPool(spec())
    rows = wire.page_rows(pool)
    tokens = list(range(16 * 16))
    sender_rows = expected_rows(pool.spec, tokens, 0)
    receiver, sender = UcxTransport(), UcxTransport(drain_timeout=0.5)

    async def push(transfer_id: int, receive: bool) -> tuple:
        plan = wire.TransferPlan.build(rows, transfer_id, 16, 2, 1 << 20, list(range(20, 36)), pieces=True)
        received = receiver.receive(plan, rows, torch.arange(20, 36)) if receive else None
        outbox = sender.outbox(plan, torch.device("cpu"), in_place=True)
        outbox.pack(list(plan.messages), sender_rows, torch.arange(16))
        assert outbox.reads_pages and not outbox.released.is_set()
        pushing = asyncio.ensure_future(sender.push("127.0.0.1", receiver.port, outbox))
        waited = await asyncio.to_thread(outbox.wait_released, 1.0)  # from the producer's thread
        if received is not None:
            await asyncio.wait_for(received.wait(), 10)
        with contextlib.suppress(TransportError):
            await asyncio.wait_for(pushing, 10)
        return waited, outbox.released.is_set(), pushing.exception() if pushing.done() else None

    async def run():
        await receiver.start(listen=True)
        await sender.start(listen=False)
        return await push(77, receive=True), await push(78, receive=False)

    (sent, released, error), (dropped_sent, dropped_released, dropped_error) = loop.run(run(), timeout=60)
    assert (sent, released, error) == (True, True, None)
    assert_pages(pool, tokens, list(range(20, 36)), 0)
    assert not dropped_sent and dropped_released and isinstance(dropped_error, TransportError)
    loop.run(receiver.close())
    loop.run(sender.close())


@pytest.mark.parametrize("src,dst,in_place", [
    (list(range(16)), [*range(20, 28), *range(40, 48)], True),  # the node's one run cut where the decode side's are
    ([*range(8), *range(30, 38)], list(range(20, 36)), True),  # a source break inside a destination run: gathered
    (list(range(16)), list(range(20, 36)), False),  # a node that does not hold its pages: gathered
])
def test_pieces_arrive_intact_whatever_the_two_sides_runs(src, dst, in_place):
    """A plan of pieces (what an in-place decode side asks for) is cut where the decode side's runs are; the node sends
    exactly those pieces: from its pool where its own pages line up, else from a staging buffer cut the same way."""
    from m3sdk.disagg.ucx_transport import UcxTransport

    pool = KVPool(spec())
    rows = wire.page_rows(pool)
    tokens = list(range(16 * 16))
    sender_rows = expected_rows(pool.spec, tokens, 0)
    receiver, sender = UcxTransport(), UcxTransport(drain_timeout=0.5)
    # the sender's pool holds the pattern of page i at src[i]
    moved = [[torch.zeros(64, *t.shape[1:], dtype=t.dtype) for t in layer] for layer in sender_rows]
    for layer, tensors in zip(moved, sender_rows, strict=True):
        for t, want in zip(layer, tensors, strict=True):
            t[src] = want

    async def run():
        await receiver.start(listen=True)
        await sender.start(listen=False)
        plan = wire.TransferPlan.build(rows, 91, 16, 2, 64 << 10, dst, pieces=True)
        received = receiver.receive(plan, rows, torch.tensor(dst))
        outbox = sender.outbox(plan, torch.device("cpu"), in_place=in_place)
        outbox.pack(list(plan.messages), moved, torch.tensor(src))
        pushing = asyncio.ensure_future(sender.push("127.0.0.1", receiver.port, outbox))
        await asyncio.wait_for(received.wait(), 10)
        await asyncio.wait_for(pushing, 10)
        return plan.pieces, outbox.reads_pages

    pieces, reads_pages = loop.run(run(), timeout=30)
    assert pieces and reads_pages == (in_place and src == list(range(16)))
    assert_pages(pool, tokens, dst, 0)
    loop.run(receiver.close())
    loop.run(sender.close())


def test_health_stays_answered_while_many_staged_prefills_run():
    """12 prefills in flight at once on the node, every message staged on both sides, one layer per message group:
    Health, polled from another thread, answers every time within 1 s, and every page arrives where it belongs."""
    from m3sdk.disagg._proto.m3sdk_disagg_pb2_grpc import PrefillNodeStub
    from m3sdk.disagg.ucx_transport import UcxTransport

    proc, address = spawn_node("bf16", "plain", delay_s=0.2, max_in_flight=16)
    client, pool = make_client(address, layers_per_group=1, max_message_bytes=64 << 10,
                               transport=UcxTransport(in_place=False))
    waits: list[float] = []
    failures: list[str] = []
    done = threading.Event()

    def poll() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = PrefillNodeStub(channel)
            while not done.is_set():
                t = time.monotonic()
                try:
                    stub.Health(pb.HealthRequest(), timeout=1.0, metadata=(("authorization", f"Bearer {TOKEN}"),))
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")
                waits.append(time.monotonic() - t)
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        prompts = [[(i * 7 + r) % VOCAB for i in range(80)] for r in range(12)]  # 5 pages each, 60 of 64 pages
        futures = [client.submit(f"r{r}", p, GREEDY, list(range(5 * r, 5 * r + 5)), num_cached_pages=0,
                                 timeout_s=60) for r, p in enumerate(prompts)]
        results = [f.result(60) for f in futures]
    finally:
        done.set()
        poller.join()
        client.close()
        stop_node(proc)
    assert [r.first_token for r in results] == [first_token(p) for p in prompts]
    for r, p in enumerate(prompts):
        assert_pages_of(pool, p, list(range(5 * r, 5 * r + 5)))
    assert not failures and len(waits) >= 3, (failures, len(waits))
    assert max(waits) < 1.0, max(waits)


def assert_pages_of(pool: KVPool, tokens: list[int], pages: list[int]) -> None:
    """`tokens`' pattern rows in `pages` (other requests' pages written beside them are theirs to check)."""
    want = expected_rows(pool.spec, tokens, 0)
    for got_layer, want_layer in zip(wire.page_rows(pool), want, strict=True):
        for got, expected in zip(got_layer, want_layer, strict=True):
            assert torch.equal(got[torch.tensor(pages)], expected)
