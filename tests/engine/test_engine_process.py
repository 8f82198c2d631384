"""The engine core in a process of its own (`engine_process=True`) on the bundled m3-tiny, held against the
in-thread engine: the same greedy tokens and outcomes for generate, stream, chat, n=2, a JSON schema, an abort
mid-stream and a timeout; bad requests refused before queueing; the child's death reaches every waiter."""

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import anyio
import pytest
import pytest_asyncio
from test_engine_api import settle

from m3sdk import Engine, EngineDeadError, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = dict(model="m3-tiny", device="cpu", max_model_len=256, max_num_seqs=4, kv_cache_memory=1 << 22)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Tell me about Emma."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines():
    """(in-thread, own process), both running for the module's tests."""
    async with Engine(**CONFIG) as local, Engine(**CONFIG, engine_process=True) as remote:
        yield local, remote


def engine_children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == "m3sdk-engine-core"]


def latencies_observed(e: Engine) -> float:
    (line,) = [x for x in e.metrics_text().splitlines() if x.startswith("m3sdk:e2e_request_latency_seconds_count")]
    return float(line.rpartition(" ")[2])


async def test_generate_stream_chat_and_n2_match_the_thread(engines):
    local, remote = engines
    observed = latencies_observed(remote)
    for e in engines:
        assert e.max_model_len == 256 and e.describe()["model"].endswith("m3-tiny")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want, got = [await e.generate("Once upon a time", greedy) for e in engines]
    assert got.token_ids == want.token_ids and got.text == want.text and len(got.token_ids) == 12
    assert got.usage == want.usage and got.finish_reason == "length"
    assert 0 < got.timings.ttft_s <= got.timings.e2e_s
    chunks = [c async for c in remote.stream("Once upon a time", greedy)]
    assert [t for c in chunks for t in c.token_ids] == want.token_ids and len(chunks) > 1
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    want, got = [await e.chat(CHAT, max_tokens=10, temperature=0) for e in engines]
    assert got.message == want.message and got.text == want.text
    two = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2, ignore_eos=True)
    want, got = [await e.generate([5, 6, 7, 8, 9], two) for e in engines]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert got.outputs[0].token_ids != got.outputs[1].token_ids and got.usage.completion_tokens == 16
    # latencies are observed in this process from the child's finishes: one per choice
    assert latencies_observed(remote) == observed + 5


async def test_json_schema_matches_the_thread(engines):
    params = SamplingParams(max_tokens=40, temperature=0, structured_output={"json": SCHEMA})
    want, got = [await e.generate("A person:", params) for e in engines]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    if got.finish_reason == "stop":
        assert set(json.loads(got.text)) == {"name", "age"}


async def test_bad_requests_are_refused_before_queueing(engines):
    _, remote = engines
    steps = remote.stats()["steps"]
    with pytest.raises(InvalidRequestError, match="does not compile"):
        await remote.generate("x", max_tokens=4, structured_output={"regex": "(unclosed"})
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await remote.generate([1] * 250, max_tokens=10)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await remote.generate([10**7], max_tokens=4)
    assert remote.stats()["steps"] == steps
    assert len((await remote.generate("still serving", max_tokens=3)).token_ids) == 3


async def test_abort_mid_stream_frees_every_page(engines):
    _, remote = engines
    before = remote.stats()["requests_aborted"]
    seen = 0
    async for chunk in remote.stream("Tell me a long story", max_tokens=200, ignore_eos=True):
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    stats = await settle(remote, timeout=10.0)
    assert stats["requests_aborted"] == before + 1 and stats["running"] == stats["waiting"] == 0
    assert stats["pages_free"] == stats["pages_total"]


async def test_a_timeout_ends_as_in_the_thread(engines):
    outcomes = [await e.generate("tick tock", max_tokens=240, ignore_eos=True, timeout=0.2) for e in engines]
    assert [o.finish_reason for o in outcomes] == ["timeout", "timeout"]
    assert 0 < len(outcomes[1].token_ids) < 240
    stats = await settle(engines[1], timeout=10.0)
    assert stats["requests_timed_out"] >= 1 and stats["pages_free"] == stats["pages_total"]


async def test_killing_the_process_reaches_every_waiter():
    others = {p.pid for p in engine_children()}  # the module's engine
    async with Engine(**CONFIG, engine_process=True) as e:
        (child,) = [p for p in engine_children() if p.pid not in others]
        waiter = asyncio.create_task(e.generate("a waiting request", max_tokens=240, ignore_eos=True))
        stream = e.stream("a streamed request", max_tokens=240, ignore_eos=True)
        first = await anext(stream)
        assert first.token_ids
        os.kill(child.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="signal 9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 10)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            await e.generate("after its death")
    assert {p.pid for p in engine_children()} == others


async def test_the_childs_watchdog_reaches_every_waiter():
    """The child's loop reported dead (a phase past step_timeout: 1 ms, less than any forward here) is the same
    EngineDeadError, with its reason, for every waiter in this process."""
    async with Engine(**CONFIG, engine_process=True, step_timeout=0.001) as e:
        waiters = [asyncio.create_task(e.generate("slow", max_tokens=20, ignore_eos=True)) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), timeout=20)
        assert all(isinstance(r, EngineDeadError) and "step_timeout" in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await e.generate("after")


LEFT_RUNNING = """
import asyncio, multiprocessing
from m3sdk import Engine

async def main():
    e = Engine(model="m3-tiny", device="cpu", max_model_len=128, max_num_seqs=2, engine_process=True)
    await e.start()
    await e.generate("hi", max_tokens=2)
    print(*[p.pid for p in multiprocessing.active_children() if p.name == "m3sdk-engine-core"])

asyncio.run(main())  # returns with the engine still running: never shut down
"""


async def test_an_application_that_never_shuts_down_exits_and_leaves_no_process():
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", LEFT_RUNNING], capture_output=True,
                                   text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    (pid,) = map(int, done.stdout.split())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


async def test_unsupported_combinations_are_refused_at_config_time():
    from m3sdk import EngineConfig

    assert EngineConfig(engine_process=True, prefill_nodes=["127.0.0.1:9"]).engine_process  # run: tests/disagg
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(engine_process=True, tensor_parallel_size=2)
    from m3sdk.scheduler.continuous import ContinuousScheduler

    local = lambda *args: ContinuousScheduler.from_config(*args)  # noqa: E731 - what does not pickle
    with pytest.raises(ValueError, match="does not pickle"):
        async with Engine(**CONFIG, engine_process=True, scheduler=local):
            pass


async def test_an_image_prompt_matches_the_thread(tmp_path_factory):
    """Preprocessed in this process, encoded in the child: the in-thread engine's greedy tokens."""
    pytest.importorskip("PIL.Image")
    from oracle import ORACLE_IMAGE_TOKEN, make_vl_checkpoint, random_png

    checkpoint = make_vl_checkpoint(tmp_path_factory.mktemp("vl"))
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2,
                  kv_cache_memory=1 << 22)
    prompt = {"prompt_token_ids": [3, 4, ORACLE_IMAGE_TOKEN, 5, 6], "images": [random_png(60, 90, 1)]}
    outputs = []
    for process in (False, True):
        async with Engine(**config, engine_process=process) as e:
            outputs.append((await e.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True)).token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


async def test_a_build_error_is_raised_by_start_as_in_the_thread(tmp_path):
    errors = []
    for process in (False, True):
        with pytest.raises(Exception) as info:
            async with Engine(**{**CONFIG, "model": str(tmp_path)}, engine_process=process):
                pass
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0]) and str(errors[1]) == str(errors[0])


async def test_a_trio_program_drives_the_engine_process():
    async def main() -> tuple[list[int], list[int]]:
        async with Engine(**CONFIG, engine_process=True) as e:
            done = await e.generate("hello", max_tokens=6, temperature=0, ignore_eos=True)
            chunks = [c async for c in e.stream("hello", max_tokens=6, temperature=0, ignore_eos=True)]
        return done.token_ids, [t for c in chunks for t in c.token_ids]

    whole, streamed = await anyio.to_thread.run_sync(lambda: anyio.run(main, backend="trio"))
    assert whole == streamed and len(whole) == 6
