"""The decode side of disaggregation with its engine core in a process of its own (`engine_process=True`): the
remote prefill client and its transport live in the engine process, against a prefill node running the real engine
in another process (127.0.0.1)."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

pytest.importorskip("ucxx")

from disagg_helpers import spawn_engine_node, stop_node  # noqa: E402

from m3sdk import Engine, InvalidRequestError  # noqa: E402
from m3sdk.core.admission_checks import AdmissionChecks  # noqa: E402
from m3sdk.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

# far above remote_prefill_min_tokens and MSA's 24 tokens; no prefix shared (each is prefilled remotely whole)
PROMPT, OTHER, THIRD = ([(7 * i + 3 * k) % 251 + 1 for i in range(100)] for k in range(1, 4))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def node(engine_checkpoint):
    proc, address = spawn_engine_node(engine_checkpoint)
    yield address
    stop_node(proc)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(engine_checkpoint, node):
    """(colocated in-thread, decode engine in its own process with the node), both running for the module."""
    async with Engine(model=str(engine_checkpoint), device="cpu", kv_cache_memory=8 << 20) as local, \
            decode_engine(engine_checkpoint, [node], prefill_fallback="error") as remote:
        yield local, remote


def decode_engine(checkpoint, nodes, **kwargs) -> Engine:
    return Engine(model=str(checkpoint), device="cpu", kv_cache_memory=8 << 20, engine_process=True,
                  prefill_nodes=nodes, remote_prefill_min_tokens=32, **kwargs)


async def settle(engine: Engine, timeout: float = 10.0) -> dict:
    """Stats once every page is free again (an abort and a dropped transfer reach the core asynchronously)."""
    deadline = time.monotonic() + timeout
    while (stats := engine.stats())["pages_free"] != stats["pages_total"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return stats


async def test_remote_prefill_in_the_engine_process_is_greedy_identical_to_colocated(engines):
    local, remote = engines
    want = await local.generate(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS)
    got = await remote.generate(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS)
    assert got.token_ids == want.token_ids
    stats = await settle(remote)
    assert (stats["remote_prefills"], stats["remote_prefill_fallbacks"], stats["remote_prefill_failures"]) == (1, 0, 0)
    assert stats["remote_prefill_bytes"] > 0
    assert remote._admission is None  # the parent holds no client: the engine process does
    assert stats["pages_free"] == stats["pages_total"]


async def test_structured_output_is_refused_before_queueing_as_in_the_thread(engines):
    _, remote = engines
    before = remote.stats()
    params = SamplingParams(max_tokens=4, structured_output={"json": {"type": "object"}})
    with pytest.raises(InvalidRequestError) as refused:
        remote.stream(PROMPT, params)  # validated in this call, in this process
    with pytest.raises(InvalidRequestError) as in_thread:
        AdmissionChecks(remote_prefill=True).check_params(params)  # the rule EngineCore.new_request applies
    assert str(refused.value) == str(in_thread.value) and "prefill_nodes" in str(refused.value)
    after = remote.stats()
    assert (after["steps"], after["prompt_tokens"]) == (before["steps"], before["prompt_tokens"])  # never queued


async def test_abort_mid_stream_frees_every_page(engines):
    _, remote = engines
    before = remote.stats()
    seen = 0
    async for chunk in remote.stream(OTHER, temperature=0.0, max_tokens=200, ignore_eos=True):
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    stats = await settle(remote)
    assert stats["requests_aborted"] == before["requests_aborted"] + 1
    assert stats["remote_prefills"] == before["remote_prefills"] + 1
    assert stats["running"] == stats["waiting"] == 0 and stats["pages_free"] == stats["pages_total"]
    # the engine keeps serving
    assert len((await remote.generate(PROMPT, temperature=0.0, max_tokens=2)).token_ids) == 2


async def test_abort_mid_prefill_and_node_killed_mid_prefill_as_in_the_thread(engine_checkpoint, engines):
    local, _ = engines
    want = (await local.generate(THIRD, temperature=0.0, max_tokens=MAX_TOKENS)).token_ids
    proc, address = spawn_engine_node(engine_checkpoint, delay_s=3.0)
    try:
        async with decode_engine(engine_checkpoint, [address], prefill_timeout=30.0) as engine:
            # a request cancelled while the node prefills it: the engine process drops the job and frees its pages
            # once the cancel is through (no step emits then: the idle engine process sends its stats)
            task = asyncio.ensure_future(engine.generate(OTHER, temperature=0.0, max_tokens=MAX_TOKENS))
            await asyncio.sleep(0.5)
            assert engine.stats()["pages_free"] < engine.stats()["pages_total"]  # held for the node's transfer
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while (stats := engine.stats())["pages_free"] != stats["pages_total"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert stats["requests_aborted"] == 1 and stats["pages_free"] == stats["pages_total"]
            task = asyncio.ensure_future(engine.generate(THIRD, temperature=0.0, max_tokens=MAX_TOKENS))
            await asyncio.sleep(1.0)
            proc.kill()
            assert (await task).token_ids == want  # prefilled in the engine process after all, into the same pages
            stats = await settle(engine)
            assert (stats["remote_prefills"], stats["remote_prefill_failures"], stats["remote_prefill_fallbacks"]) \
                == (0, 1, 1)
            assert stats["pages_free"] == stats["pages_total"]
    finally:
        stop_node(proc)
