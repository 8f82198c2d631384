"""The async face: streaming, cancellation and abort free pages, bad inputs are refused before queueing and
the engine keeps serving, overload and a dead engine thread are typed errors that reach every waiter."""

import asyncio
import contextlib
import logging
import random
import time

import pytest
import structlog

from m3sdk import (
    Engine,
    EngineConfig,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
)


def engine(checkpoint, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", max_model_len=128, max_num_seqs=16,
                  max_num_batched_tokens=64, kv_cache_memory=1 << 21)
    return Engine(**{**config, **overrides})


async def settle(e: Engine, timeout: float = 5.0) -> dict:
    """Stats once nothing is live any more (aborts reach the core asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = e.stats()
        if stats["running"] == stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


async def test_stream_deltas_add_up_to_generate(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        done = await e.generate("Once upon a time", max_tokens=20, temperature=0, ignore_eos=True)
        chunks = [c async for c in e.stream("Once upon a time", SamplingParams(max_tokens=20, temperature=0),
                                            ignore_eos=True)]
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids and len(done.token_ids) == 20
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    assert done.usage.prompt_tokens == 16 and done.usage.completion_tokens == 20
    assert done.timings.ttft_s is not None and done.timings.e2e_s >= done.timings.ttft_s


async def test_prompt_forms_and_stops(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        chat = [{"role": "user", "content": "hi"}]
        by_chat = await e.generate(chat, max_tokens=4, temperature=0, ignore_eos=True)
        by_ids = await e.generate(list(b"<user>hi\n<assistant>"), max_tokens=4, temperature=0, ignore_eos=True)
        assert by_chat.token_ids == by_ids.token_ids and by_chat.usage.prompt_tokens == 20
        # a stop string cut out of the text, a stop token id, logprobs
        free = await e.generate("abc", max_tokens=12, temperature=0, ignore_eos=True)
        stop = free.text[3:5]
        cut = await e.generate("abc", max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
        assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]
        tok = await e.generate("abc", max_tokens=12, temperature=0, ignore_eos=True,
                               stop_token_ids=[free.token_ids[2]])
        assert tok.finish_reason == "stop" and tok.token_ids == free.token_ids[:3]
        lp = await e.generate("abc", max_tokens=3, temperature=0, ignore_eos=True, logprobs=2)
        assert len(lp.logprobs) == 3 and all(len(t.top_logprobs) == 2 for t in lp.logprobs)
        assert [t.token_id for t in lp.logprobs] == lp.token_ids == free.token_ids[:3]


async def test_64_streams_with_random_cancels_and_aborts_free_every_page(engine_checkpoint):
    rng = random.Random(0)
    async with engine(engine_checkpoint, max_num_seqs=64, kv_cache_memory=1 << 22) as e:
        total = e.stats()["pages_total"]
        outcomes = []

        async def client(i: int) -> None:
            fate = rng.choice(["finish", "break", "cancel", "abort"])
            rid = f"req-{i}"
            prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(4, 60))]
            n = 0
            async for chunk in e.stream(prompt, request_id=rid, max_tokens=rng.randrange(8, 40), ignore_eos=True):
                n += len(chunk.token_ids)
                if chunk.finish_reason:
                    outcomes.append(chunk.finish_reason)
                if fate == "break" and n >= 3:
                    outcomes.append("break")
                    break
                if fate == "abort" and n >= 2:
                    await e.abort(rid)
                    await e.abort(rid)  # idempotent

        tasks = [asyncio.create_task(client(i)) for i in range(64)]
        await asyncio.sleep(0.3)
        for t in tasks[::5]:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
        stats = await settle(e)
        assert stats["running"] == stats["waiting"] == 0
        assert stats["pages_free"] == total
        assert all(n == 0 for n in e._core.cache.pool.ref_counts)
        assert {"length", "abort", "break"} <= set(outcomes)
        await e.abort("req-0")  # finished ids are a no-op
        assert (await e.generate("still serving", max_tokens=3)).finish_reason in ("length", "stop")


async def test_cancelling_generate_aborts_the_request(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        task = asyncio.create_task(e.generate("abc", max_tokens=100, ignore_eos=True))
        while e.stats()["generation_tokens"] < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await settle(e)
        assert stats["requests_aborted"] == 1 and stats["pages_free"] == stats["pages_total"]


async def test_abort_ends_generate_with_abort(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        task = asyncio.create_task(e.generate("abc", request_id="x", max_tokens=100, ignore_eos=True))
        while e.stats()["generation_tokens"] < 2:
            await asyncio.sleep(0.005)
        await e.abort("x")
        done = await task
        assert done.finish_reason == "abort" and 0 < len(done.token_ids) < 100


BAD = [
    ("", {}, InvalidRequestError),
    ([], {}, InvalidRequestError),
    ([1, 2, 256], {}, InvalidRequestError),
    ([1, -1], {}, InvalidRequestError),
    ([1, 2.0], {}, InvalidRequestError),
    ([1, True], {}, InvalidRequestError),
    ([1, "2"], {}, InvalidRequestError),
    (b"bytes", {}, InvalidRequestError),
    (42, {}, InvalidRequestError),
    (list(range(3, 131)), {}, InvalidRequestError),  # 128 tokens: no room in max_model_len 128
    ([5] * 100, {"max_tokens": 29}, InvalidRequestError),  # 100 + 29 > 128
    ("x", {"max_tokens": 0}, InvalidRequestError),
    ("x", {"temperature": -0.1}, InvalidRequestError),
    ("x", {"top_p": 0.0}, InvalidRequestError),
    ("x", {"top_p": 1.5}, InvalidRequestError),
    ("x", {"top_k": 0}, InvalidRequestError),
    ("x", {"top_k": -2}, InvalidRequestError),
    ("x", {"min_p": 1.5}, InvalidRequestError),
    ("x", {"repetition_penalty": 0.0}, InvalidRequestError),
    ("x", {"presence_penalty": 3.0}, InvalidRequestError),
    ("x", {"frequency_penalty": -3.0}, InvalidRequestError),
    ("x", {"stop": 5}, InvalidRequestError),
    ("x", {"stop": ["a", 1]}, InvalidRequestError),
    ("x", {"stop_token_ids": [300]}, InvalidRequestError),
    ("x", {"request_id": ""}, InvalidRequestError),
    ("x", {"priority": "high"}, InvalidRequestError),
    ([{"content": "no role"}], {}, InvalidRequestError),
    # text that is not valid Unicode, content of another type, values float32 cannot sample, unbounded stops
    ("a\ud800b", {}, InvalidRequestError),
    ([{"role": "user", "content": 5}], {}, InvalidRequestError),
    ([{"role": "user", "content": None}], {}, InvalidRequestError),  # this template concatenates it
    ([{"role": "user", "content": "\udfff"}], {}, InvalidRequestError),
    ([{"role": ["user"], "content": "x"}], {}, InvalidRequestError),
    ("x", {"temperature": 1e-45}, InvalidRequestError),
    ("x", {"top_p": 1e-46}, InvalidRequestError),
    ("x", {"repetition_penalty": 1e-300}, InvalidRequestError),
    ("x", {"seed": -1}, InvalidRequestError),
    ("x", {"seed": 2**64}, InvalidRequestError),
    ("x", {"stop": ["s"] * 65}, InvalidRequestError),  # max_stop_strings 64
    ("x", {"stop": "s" * 1025}, InvalidRequestError),  # max_stop_length 1024
    ("x", {"no_such_param": 1}, TypeError),
]


async def test_bad_inputs_are_refused_before_queueing(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        for prompt, kwargs, error in BAD:
            with pytest.raises(error):
                await e.generate(prompt, **kwargs)
            with pytest.raises(error):
                e.stream(prompt, **kwargs)  # refused at the call, before any iteration
        with pytest.raises(InvalidRequestError):
            await e.generate("x", {"max_tokens": 3})
        assert e.stats()["prompt_tokens"] == 0  # nothing reached the core
        assert (await e.generate("still serving", max_tokens=3)).usage.completion_tokens >= 1
        # a live id cannot be reused
        first = e.stream("abc", request_id="dup", max_tokens=50, ignore_eos=True)
        await first.__anext__()
        with pytest.raises(InvalidRequestError):
            await e.generate("abc", request_id="dup", max_tokens=3)
        await first.aclose()
    with pytest.raises(TypeError):
        Engine(no_such_knob=1)
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=0)


async def test_overload_is_refused(engine_checkpoint):
    async with engine(engine_checkpoint, max_num_seqs=2, max_waiting_requests=3) as e:
        streams = [e.stream("abc", max_tokens=60, ignore_eos=True) for _ in range(5)]
        for s in streams:
            await s.__anext__()
        with pytest.raises(EngineOverloadedError):
            await e.generate("abc", max_tokens=2)
        for s in streams:
            await s.aclose()
        stats = await settle(e)
        assert stats["pages_free"] == stats["pages_total"]
        assert (await e.generate("abc", max_tokens=2)).usage.completion_tokens == 2


async def test_dead_engine_thread_raises_in_every_waiter_within_a_second(engine_checkpoint):
    async with engine(engine_checkpoint) as e:
        streams = [e.stream("abc", max_tokens=100, ignore_eos=True) for _ in range(6)]
        for s in streams:
            await s.__anext__()
        waiters = [asyncio.create_task(e.generate("xyz", max_tokens=100, ignore_eos=True)) for _ in range(4)]
        await asyncio.sleep(0.05)

        def crash(*args):
            raise RuntimeError("injected fault")

        e._core.runner.run = crash  # the next step fails inside the engine thread
        start = time.monotonic()

        async def drain(s):
            async for _ in s:
                pass

        results = await asyncio.wait_for(
            asyncio.gather(*waiters, *(drain(s) for s in streams), return_exceptions=True), timeout=1.0)
        assert time.monotonic() - start < 1.0
        assert all(isinstance(r, EngineDeadError) for r in results)
        with pytest.raises(EngineDeadError):
            await e.generate("abc", max_tokens=2)
        with pytest.raises(EngineDeadError):
            e.stats()


async def test_silent_unless_logging_is_configured(engine_checkpoint, capfd):
    async with engine(engine_checkpoint, kv_cache_memory=None, max_model_len=None) as e:
        await e.generate("abc", max_tokens=2)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


async def test_logs_reach_a_configured_logger(engine_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="m3sdk"):
        async with engine(engine_checkpoint):
            pass
    assert any("engine built" in r.getMessage() for r in caplog.records)


async def test_logs_reach_configured_structlog(engine_checkpoint):
    with structlog.testing.capture_logs() as logs:
        async with engine(engine_checkpoint):
            pass
    assert any(entry["event"] == "engine built" and entry["pages"] > 0 for entry in logs)


async def test_cache_knobs_pass_through(engine_checkpoint):
    async with engine(engine_checkpoint, kv_cache_dtype="fp8", index_cache_dtype="bf16") as e:
        kv = e._core.cache.kv
        assert kv.spec.kv_dtype == "fp8" and kv.k_scale[0] is not None and kv.index_k[1].dtype.itemsize == 2
        assert (await e.generate("abc", max_tokens=4)).usage.completion_tokens >= 1
    with contextlib.suppress(ValueError):
        EngineConfig(kv_cache_layout="diagonal")
        raise AssertionError("a bad layout must be refused")


async def test_a_request_id_reused_right_after_leaving_its_stream_gets_only_its_own_chunks(engine_checkpoint):
    # the left stream's abort notice (and any delta still in flight) must not reach the new request's waiter
    async with engine(engine_checkpoint) as e:
        for _ in range(3):
            async with contextlib.aclosing(e.stream("abc", request_id="x", max_tokens=50, ignore_eos=True)) as s:
                async for _chunk in s:
                    break
            done = await e.generate("abc", request_id="x", max_tokens=5, ignore_eos=True)
            assert done.finish_reason == "length" and len(done.token_ids) == 5
        stats = await settle(e)
        assert stats["requests_aborted"] == 3 and stats["pages_free"] == stats["pages_total"]
