"""The async face under each anyio backend: the same Engine serves an asyncio program and a trio program (streams,
whole completions, cancellation of the awaiting task, a dead engine thread reaching every waiter)."""

import functools
import time

import anyio
import pytest

from m3sdk import Engine, EngineDeadError

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def engine(checkpoint, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64, kv_cache_memory=1 << 21)
    return Engine(**{**config, **overrides})


async def settled(e: Engine) -> dict:
    with anyio.fail_after(5):
        while (stats := e.stats())["running"] or stats["waiting"]:
            await anyio.sleep(0.01)
    return stats


async def test_stream_and_generate_agree(engine_checkpoint, anyio_backend):
    async with engine(engine_checkpoint) as e:
        done = await e.generate("hello", max_tokens=6, temperature=0, ignore_eos=True)
        chunks = [c async for c in e.stream("hello", max_tokens=6, temperature=0, ignore_eos=True)]
        assert [t for c in chunks for t in c.token_ids] == done.token_ids and len(done.token_ids) == 6
        assert chunks[-1].finish_reason == done.finish_reason == "length"
        results = {}

        async def one(i):
            results[i] = await e.generate([10 + i, 11, 12], max_tokens=4, temperature=0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
        assert all(len(r.token_ids) == 4 for r in results.values())


async def test_cancelling_the_waiter_aborts_the_request(engine_checkpoint, anyio_backend):
    async with engine(engine_checkpoint) as e:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(e.generate, "abc", max_tokens=120, ignore_eos=True, temperature=0))
            with anyio.fail_after(10):
                while not e.stats()["generation_tokens"]:
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()  # the waiter is mid-generation
        stats = await settled(e)
        assert stats["requests_aborted"] == 1 and stats["requests_finished"] == 0
        assert stats["pages_free"] == stats["pages_total"]
        assert (await e.generate("abc", max_tokens=2)).usage.completion_tokens == 2  # still serving


async def test_dead_engine_reaches_every_waiter(engine_checkpoint, anyio_backend):
    async with engine(engine_checkpoint) as e:
        errors = []

        async def wait_one():
            try:
                await e.generate("xyz", max_tokens=100, ignore_eos=True)
            except EngineDeadError as exc:
                errors.append(exc)

        def crash(*args):
            raise RuntimeError("injected fault")

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(wait_one)
            await anyio.sleep(0.05)
            start = time.monotonic()
            e._core.runner.run = crash  # the next step fails inside the engine thread
        assert len(errors) == 3 and time.monotonic() - start < 2
        with pytest.raises(EngineDeadError):
            await e.generate("abc", max_tokens=2)
