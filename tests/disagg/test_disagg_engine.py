"""End to end: a decode Engine with prefill nodes running the real engine in other processes (127.0.0.1).

The oracle model's MSA keeps 3 blocks of 8 tokens, so prompts here are far longer than 24 tokens: wrong or
missing index keys would change which blocks decode steps attend to."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import structlog

pytest.importorskip("ucxx")

from disagg_helpers import spawn_engine_node, stop_node  # noqa: E402

from m3sdk import Engine  # noqa: E402
from m3sdk.disagg import loop  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.errors import PrefillNodeError  # noqa: E402

PROMPTS = [[(7 * i + 3 * k) % 251 + 1 for i in range(90 + 13 * k)] for k in range(4)]
MAX_TOKENS = 12



@pytest.fixture(scope="module")
def node(engine_checkpoint):
    # every forward there holds its last layer until the first group of layers was sent: each remote prefill
    # through this node proves the push overlaps compute (a node pushing after the forward fails the prefill)
    proc, address = spawn_engine_node(engine_checkpoint, hold_last_layer=True)
    yield address
    stop_node(proc)


@pytest.fixture(scope="module")
def colocated(engine_checkpoint):
    async def run():
        async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20) as engine:
            return [(await engine.generate(p, temperature=0.0, max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS]
    return asyncio.run(run())


def node_health(client, index: int = 0) -> pb.HealthReply:
    async def health():
        return await client._nodes[index].stub.Health(pb.HealthRequest(), timeout=5)
    return loop.run(health())


def assert_node_pages_free(client, index: int = 0) -> None:
    """No page leak on the node: once nothing runs there, all its pages are free (cached ones count)."""
    deadline = time.monotonic() + 5
    while (health := node_health(client, index)).running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health.running == 0
    assert health.pages_free == health.pages_total > 0


def decode_engine(checkpoint, nodes, **kwargs) -> Engine:
    return Engine(model=str(checkpoint), device="cpu", kv_cache_memory=8 << 20, prefill_nodes=nodes,
                  remote_prefill_min_tokens=32, **kwargs)


async def generate_all(engine: Engine) -> list[list[int]]:
    done = await asyncio.gather(*(engine.generate(p, temperature=0.0, max_tokens=MAX_TOKENS) for p in PROMPTS))
    return [c.token_ids for c in done]


async def test_remote_prefill_is_greedy_identical_to_colocated(engine_checkpoint, node, colocated):
    async with decode_engine(engine_checkpoint, [node], prefill_fallback="error") as engine:
        free = engine.stats()["pages_free"]
        assert await generate_all(engine) == colocated
        assert engine._admission.num_remote == len(PROMPTS)
        stats = engine.stats()
        assert (stats["remote_prefills"], stats["remote_prefill_fallbacks"]) == (len(PROMPTS), 0)
        assert stats["remote_prefill_bytes"] > 0 and stats["remote_prefill_seconds"] > 0
        metrics = engine.metrics_text()
        assert f"m3sdk:remote_prefills_total {float(len(PROMPTS))}" in metrics
        assert f"m3sdk:remote_prefill_bytes_total {float(stats['remote_prefill_bytes'])}" in metrics
        assert engine._admission.client.layers_per_group == 2  # 4 layers: two groups, the first overlaps
        assert engine.stats()["pages_free"] == free
        assert_node_pages_free(engine._admission.client)


async def test_first_token_top_logprobs_come_from_the_node(engine_checkpoint, node):
    async def run(**kwargs):
        async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20, **kwargs) as engine:
            done = await engine.generate(PROMPTS[2], temperature=0.0, max_tokens=3, logprobs=4)
            return done, engine._admission
    local, _ = await run()
    remote, rp = await run(prefill_nodes=[node], remote_prefill_min_tokens=32, prefill_fallback="error")
    assert rp.num_remote == 1
    assert remote.token_ids == local.token_ids
    for got, want in zip(remote.logprobs, local.logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        assert [lp for _, lp in got.top_logprobs] == pytest.approx([lp for _, lp in want.top_logprobs], abs=1e-5)


async def test_index_keys_travel(engine_checkpoint, colocated):
    proc, address = spawn_engine_node(engine_checkpoint, corrupt_index_keys=True)
    try:
        async with decode_engine(engine_checkpoint, [address], prefill_fallback="error") as engine:
            got = await generate_all(engine)
        # the first token comes from the node (computed before the garbling); decode steps then select blocks
        # with the index keys that arrived: garbled keys select other blocks
        assert [g[0] for g in got] == [c[0] for c in colocated]
        assert got != colocated
    finally:
        stop_node(proc)


async def test_node_killed_mid_prefill_falls_back_within_deadline_without_page_leaks(engine_checkpoint,
                                                                                     colocated):
    proc, address = spawn_engine_node(engine_checkpoint, delay_s=3.0)
    try:
        async with decode_engine(engine_checkpoint, [address], prefill_timeout=30.0) as engine:
            free = engine.stats()["pages_free"]
            task = asyncio.ensure_future(generate_all(engine))
            await asyncio.sleep(1.0)
            proc.kill()
            t0 = time.monotonic()
            assert await task == colocated
            assert time.monotonic() - t0 < 10.0
            assert engine._admission.num_fallbacks == len(PROMPTS)
            stats = engine.stats()
            assert stats["remote_prefill_failures"] == stats["remote_prefill_fallbacks"] == len(PROMPTS)
            assert stats["remote_prefills"] == 0
            assert engine.stats()["pages_free"] == free
            # with the node down, the next request is prefilled here at once
            assert (await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS)).token_ids \
                == colocated[0]
    finally:
        stop_node(proc)


async def test_fallback_error_raises_and_caller_abort_reaches_the_node(engine_checkpoint):
    proc, address = spawn_engine_node(engine_checkpoint, delay_s=3.0)
    try:
        async with decode_engine(engine_checkpoint, [address], prefill_fallback="error",
                                 prefill_timeout=1.0) as engine:
            free = engine.stats()["pages_free"]
            with pytest.raises(PrefillNodeError, match="deadline|DEADLINE"):
                await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=4)
            assert engine.stats()["pages_free"] == free
            assert_node_pages_free(engine._admission.client)  # the node gave up at the deadline too
        async with decode_engine(engine_checkpoint, [address], prefill_timeout=30.0) as engine:
            task = asyncio.ensure_future(engine.generate(PROMPTS[1], temperature=0.0, max_tokens=4))
            await asyncio.sleep(0.5)
            client = engine._admission.client
            assert node_health(client).running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert node_health(client).running == 0  # the node dropped the prefill the caller gave up on
            assert engine.stats()["pages_free"] == free
            assert_node_pages_free(client)
    finally:
        stop_node(proc)


async def test_two_nodes_one_engine_and_one_node_two_engines(engine_checkpoint, node, colocated):
    proc, second = spawn_engine_node(engine_checkpoint)
    try:
        async with decode_engine(engine_checkpoint, [node, second], prefill_fallback="error") as engine:
            assert await generate_all(engine) == colocated
            assert set(engine._admission.nodes_used) == {node, second}
            for index in range(2):
                assert_node_pages_free(engine._admission.client, index)
        async with decode_engine(engine_checkpoint, [second], prefill_fallback="error") as a, \
                decode_engine(engine_checkpoint, [second], prefill_fallback="error") as b:
            assert await asyncio.gather(generate_all(a), generate_all(b)) == [colocated, colocated]
    finally:
        stop_node(proc)


async def test_handshake_runs_off_the_callers_event_loop(engine_checkpoint, colocated):
    # a "node" that accepts TCP connections and never answers: the handshake waits out its connect timeout
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        gaps, ticking = [], True

        async def tick():
            last = time.monotonic()
            while ticking:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        t0 = time.monotonic()
        async with decode_engine(engine_checkpoint, [f"127.0.0.1:{silent.getsockname()[1]}"]) as engine:
            started = time.monotonic() - t0
            ticking = False
            await ticker
            assert started > 4.0  # the handshake did wait (connect timeout 5 s)...
            assert max(gaps) < 1.0  # ...without blocking this loop
            # the node is unreachable: prompts are prefilled here at once, and the fallback says so: a log line with
            # its reason, and the stats count it
            with structlog.testing.capture_logs() as logs:
                assert (await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS)).token_ids \
                    == colocated[0]
            assert engine._admission.num_remote == 0
            assert engine.stats()["remote_prefill_fallbacks"] == 1
            assert "m3sdk:remote_prefill_fallbacks_total 1.0" in engine.metrics_text()
            fallbacks = [e for e in logs if e["event"].startswith("remote prefill fallback")]
            assert len(fallbacks) == 1 and fallbacks[0]["reason"].startswith("no healthy prefill node"), logs
