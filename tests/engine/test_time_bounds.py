"""Time bounds of the embedded engine: per-request timeouts end requests with "timeout" and return their pages;
the watchdog turns a stuck step into EngineDeadError for every waiter, naming the phase."""

import asyncio
import threading
import time

import pytest

from m3sdk import Engine, EngineDeadError, SamplingParams


def engine(checkpoint, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=64, kv_cache_memory=1 << 21)
    return Engine(**{**config, **overrides})


async def settled(e: Engine, free: int, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := e.stats())["pages_free"] != free and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return stats


async def test_a_timeout_ends_the_request_and_returns_its_pages(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        free = e.stats()["pages_free"]
        slow = threading.Event()

        def pace(module, args):  # 20 ms a forward: 200 tokens cannot finish in 0.3 s
            if slow.is_set():
                time.sleep(0.02)

        e._core.runner.model.layers[0].register_forward_pre_hook(pace)
        slow.set()
        t0 = time.monotonic()
        # four running and four waiting (max_num_seqs 4): waiting ones time out too
        done = await asyncio.gather(*(e.generate("tick tock", max_tokens=200, ignore_eos=True, timeout=0.3)
                                      for _ in range(8)))
        took = time.monotonic() - t0
        assert {c.finish_reason for c in done} == {"timeout"}
        assert all(len(c.token_ids) < 200 for c in done)
        assert took < 2.0
        # a timeout passed to SamplingParams is the same; one long enough does not fire
        slow.clear()
        ok = await e.generate("tick tock", SamplingParams(max_tokens=5, ignore_eos=True, timeout=30.0))
        assert ok.finish_reason == "length" and len(ok.token_ids) == 5
        stats = await settled(e, free)
        assert stats["pages_free"] == free and stats["requests_timed_out"] == 8
        assert stats["running"] == stats["waiting"] == 0


async def test_the_watchdog_ends_a_stuck_engine_for_every_waiter(engine_checkpoint):
    async with engine(engine_checkpoint, step_timeout=0.5) as e:
        assert (await e.generate("fine", max_tokens=3)).usage.completion_tokens == 3
        release = threading.Event()

        def stuck(module, args):  # a forward that never returns (until the test ends)
            release.wait(30)

        e._core.runner.model.layers[0].register_forward_pre_hook(stuck)
        waiters = [asyncio.create_task(e.generate("hang", max_tokens=20, ignore_eos=True)) for _ in range(6)]
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), timeout=5.0)
        assert time.monotonic() - t0 < 3.0
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "launch the forward" in str(results[0]) and "step_timeout" in str(results[0])
        with pytest.raises(EngineDeadError):
            await e.generate("after", max_tokens=2)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0  # shutdown does not wait for the stuck thread past step_timeout
    release.set()
    e._core.join(10)  # the stuck step returns now and its loop ends without emitting
    assert not e._core._thread.is_alive()
