"""End to end: a decode Engine with prefill nodes running the real engine in other processes (127.0.0.1).

The oracle model's MSA keeps 3 blocks of 8 tokens, so prompts here are far longer than 24 tokens: wrong or
missing index keys would change which blocks decode steps attend to."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("ucxx")

from disagg_helpers import spawn_engine_node, stop_node  # noqa: E402

from m3sdk import Engine  # noqa: E402
from m3sdk.disagg import loop  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.errors import PrefillNodeError  # noqa: E402

PROMPTS = [[(7 * i + 3 * k) % 251 + 1 for i in range(90 + 13 * k)] for k in range(4)]
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def node(disagg_checkpoint):
    proc, address = spawn_engine_node(disagg_checkpoint)
    yield address
    stop_node(proc)


@pytest.fixture(scope="module")
def colocated(disagg_checkpoint):
    async def run():
        async with Engine(model=str(disagg_checkpoint), device="cpu", kv_cache_memory=8 << 20) as engine:
            return [(await engine.generate(p, temperature=0.0, max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS]
    return asyncio.run(run())


def node_running(client) -> int:
    async def health():
        return (await client._nodes[0].stub.Health(pb.HealthRequest(), timeout=5)).running
    return loop.run(health())


def decode_engine(checkpoint, nodes, **kwargs) -> Engine:
    return Engine(model=str(checkpoint), device="cpu", kv_cache_memory=8 << 20, prefill_nodes=nodes,
                  remote_prefill_min_tokens=32, **kwargs)


async def generate_all(engine: Engine) -> list[list[int]]:
    done = await asyncio.gather(*(engine.generate(p, temperature=0.0, max_tokens=MAX_TOKENS) for p in PROMPTS))
    return [c.token_ids for c in done]


async def test_remote_prefill_is_greedy_identical_to_colocated(disagg_checkpoint, node, colocated):
    async with decode_engine(disagg_checkpoint, [node], prefill_fallback="error") as engine:
        free = engine.stats()["pages_free"]
        assert await generate_all(engine) == colocated
        assert engine._core.remote.num_remote == len(PROMPTS)
        assert engine.stats()["pages_free"] == free


async def test_index_keys_travel(disagg_checkpoint, colocated):
    proc, address = spawn_engine_node(disagg_checkpoint, corrupt_index_keys=True)
    try:
        async with decode_engine(disagg_checkpoint, [address], prefill_fallback="error") as engine:
            got = await generate_all(engine)
        # the first token comes from the node (computed before the garbling); decode steps then select blocks
        # with the index keys that arrived: garbled keys select other blocks
        assert [g[0] for g in got] == [c[0] for c in colocated]
        assert got != colocated
    finally:
        stop_node(proc)


async def test_node_killed_mid_prefill_falls_back_within_deadline_without_page_leaks(disagg_checkpoint,
                                                                                     colocated):
    proc, address = spawn_engine_node(disagg_checkpoint, delay_s=3.0)
    try:
        async with decode_engine(disagg_checkpoint, [address], prefill_timeout=30.0) as engine:
            free = engine.stats()["pages_free"]
            task = asyncio.ensure_future(generate_all(engine))
            await asyncio.sleep(1.0)
            proc.kill()
            t0 = time.monotonic()
            assert await task == colocated
            assert time.monotonic() - t0 < 10.0
            assert engine._core.remote.num_fallbacks == len(PROMPTS)
            assert engine.stats()["pages_free"] == free
            # with the node down, the next request is prefilled here at once
            assert (await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS)).token_ids \
                == colocated[0]
    finally:
        stop_node(proc)


async def test_fallback_error_raises_and_caller_abort_reaches_the_node(disagg_checkpoint):
    proc, address = spawn_engine_node(disagg_checkpoint, delay_s=3.0)
    try:
        async with decode_engine(disagg_checkpoint, [address], prefill_fallback="error",
                                 prefill_timeout=1.0) as engine:
            free = engine.stats()["pages_free"]
            with pytest.raises(PrefillNodeError, match="deadline|DEADLINE"):
                await engine.generate(PROMPTS[0], temperature=0.0, max_tokens=4)
            assert engine.stats()["pages_free"] == free
        async with decode_engine(disagg_checkpoint, [address], prefill_timeout=30.0) as engine:
            task = asyncio.ensure_future(engine.generate(PROMPTS[1], temperature=0.0, max_tokens=4))
            await asyncio.sleep(0.5)
            client = engine._core.remote.client
            assert node_running(client) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert node_running(client) == 0  # the node dropped the prefill the caller gave up on
            assert engine.stats()["pages_free"] == free
    finally:
        stop_node(proc)


async def test_two_nodes_one_engine_and_one_node_two_engines(disagg_checkpoint, node, colocated):
    proc, second = spawn_engine_node(disagg_checkpoint)
    try:
        async with decode_engine(disagg_checkpoint, [node, second], prefill_fallback="error") as engine:
            assert await generate_all(engine) == colocated
            assert set(engine._core.remote.nodes_used) == {node, second}
        async with decode_engine(disagg_checkpoint, [second], prefill_fallback="error") as a, \
                decode_engine(disagg_checkpoint, [second], prefill_fallback="error") as b:
            assert await asyncio.gather(generate_all(a), generate_all(b)) == [colocated, colocated]
    finally:
        stop_node(proc)
