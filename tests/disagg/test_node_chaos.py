"""Chaos: a prefill node (the real engine, a process of its own) killed with SIGKILL in the middle of transfers and
restarted on the same port, twice, under a decode Engine with per-request timeouts. Every request completes with
the colocated greedy tokens within its timeout, the restarted node is used again, and neither side keeps a page."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ucxx")

from disagg_helpers import spawn_engine_node, stop_node, wait_healthy  # noqa: E402

from m3sdk import Engine  # noqa: E402

# a batch of 4 prompts per phase (fresh ones: a prompt the decode side has cached is not sent to a node)
BATCHES = [[[(11 * i + 5 * k + 3 * b) % 251 + 1 for i in range(80 + 17 * k)] for k in range(4)] for b in range(4)]
MAX_TOKENS, TIMEOUT = 6, 30.0


async def generate_all(engine: Engine, batch: int) -> list:
    return await asyncio.gather(*(engine.generate(p, temperature=0.0, max_tokens=MAX_TOKENS, timeout=TIMEOUT)
                                  for p in BATCHES[batch]))


async def test_node_killed_mid_transfer_and_restarted(engine_checkpoint):
    async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20) as local:
        colocated = [[c.token_ids for c in await generate_all(local, b)] for b in range(len(BATCHES))]
    proc, address = spawn_engine_node(engine_checkpoint, delay_s=0.4)
    try:
        async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20,
                          prefill_nodes=[address], remote_prefill_min_tokens=32, prefill_timeout=10.0) as engine:
            free = engine.stats()["pages_free"]
            remote = engine._admission
            for kill in range(2):
                t0 = time.monotonic()
                batch = asyncio.ensure_future(generate_all(engine, 2 * kill))
                await asyncio.sleep(0.2)  # the prefills are on the node, its compute held by delay_s
                proc.kill()
                done = await batch
                assert [c.token_ids for c in done] == colocated[2 * kill]
                assert all(c.finish_reason == "length" for c in done)
                assert time.monotonic() - t0 < TIMEOUT
                proc.join(10)
                proc, _ = spawn_engine_node(engine_checkpoint, delay_s=0.4, listen=address)
                await wait_healthy(engine)
                used = remote.num_remote
                assert [c.token_ids for c in await generate_all(engine, 2 * kill + 1)] == colocated[2 * kill + 1]
                assert remote.num_remote > used  # the restarted node served again
            assert remote.num_fallbacks >= 2
            deadline = time.monotonic() + 5
            while engine.stats()["pages_free"] != free and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.stats()["pages_free"] == free
    finally:
        stop_node(proc)
