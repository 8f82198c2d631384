"""Property tests of the embedded API (hypothesis, bounded examples): whatever a caller passes as sampling
parameters, prompt or chat messages, the outcome is either a typed error raised before anything is queued or a
served request (tokens in the vocabulary, finite log-probabilities, a known finish reason); the engine keeps
serving and every page comes back."""

from __future__ import annotations

import asyncio
import math
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3sdk import Engine, InvalidRequestError

EXAMPLES = int(os.environ.get("M3SDK_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
VOCAB = 256  # the test checkpoint's

# numbers around every edge SamplingParams has, and the float32 ones it must refuse
edge_floats = st.sampled_from([0.0, -0.0, 1e-45, 1e-46, 1e-300, 5e-324, 1e-7, 1e-6, 1e-3, 1e-2, 0.5, 1.0, 2.0, 100.0,
                               1e3, 1e4, 1e300, -1.0, -2.0, 3.0, math.inf, -math.inf, math.nan])
numbers = st.one_of(edge_floats, st.floats(allow_nan=True, allow_infinity=True, width=64),
                    st.integers(-2**70, 2**70), st.booleans(), st.none(), st.text(max_size=3))
odd_text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=8)  # lone surrogates included
stops = st.one_of(st.none(), odd_text, st.lists(odd_text, max_size=70), st.integers(), st.just("s" * 1100))


def valid_or(ok: st.SearchStrategy) -> st.SearchStrategy:
    """Half the time a value in range (so that requests are served), else anything."""
    return st.one_of(ok, ok, ok, numbers)


params = st.fixed_dictionaries({}, optional={
    "temperature": valid_or(st.floats(0, 2)), "top_p": valid_or(st.floats(1e-6, 1)),
    "top_k": valid_or(st.integers(1, 300)), "min_p": valid_or(st.floats(0, 1)),
    "repetition_penalty": valid_or(st.floats(0.01, 100)), "presence_penalty": valid_or(st.floats(-2, 2)),
    "frequency_penalty": valid_or(st.floats(-2, 2)), "seed": valid_or(st.integers(-2**65, 2**65)),
    "logprobs": valid_or(st.integers(-2, 25)), "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), stops),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 300), max_size=70), numbers),
    "max_tokens": valid_or(st.integers(-1, 6)), "ignore_eos": st.one_of(st.booleans(), numbers),
    "timeout": st.one_of(st.none(), st.floats(min_value=-1, max_value=60), numbers),
})
token_lists = st.lists(st.one_of(st.integers(-5, VOCAB + 5), st.booleans(), st.floats(), st.text(max_size=2)),
                       max_size=40)
contents = st.one_of(odd_text, st.none(), st.integers(), st.lists(st.text(max_size=3), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": contents}),
    st.fixed_dictionaries({"role": st.one_of(odd_text, st.integers(), st.none()), "content": odd_text}),
    st.fixed_dictionaries({}, optional={"content": odd_text}),
), max_size=4)
prompts = st.one_of(odd_text.filter(lambda t: len(t) < 40), token_lists, messages, st.binary(max_size=8),
                    st.integers(), st.none())


@pytest.fixture(scope="module")
def served(engine_checkpoint):
    """An engine on a loop of its own thread: each example calls into it and waits."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = Engine(model=str(engine_checkpoint), device="cpu", max_model_len=128, max_num_seqs=8,
                    max_num_batched_tokens=64, kv_cache_memory=1 << 21)
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(120)
    tally = {"served": 0, "refused": 0}
    yield engine, loop, tally
    print(f"\nfuzzed requests: {tally}")
    asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _call(served, prompt, kwargs) -> None:
    engine, loop, tally = served
    before = engine.stats()["prompt_tokens"]
    try:
        done = asyncio.run_coroutine_threadsafe(engine.generate(prompt, **kwargs), loop).result(60)
    except InvalidRequestError:
        tally["refused"] += 1
        assert engine.stats()["prompt_tokens"] == before  # refused before anything was queued
        return
    tally["served"] += 1
    assert done.finish_reason in ("stop", "length", "timeout")
    assert all(0 <= t < VOCAB for t in done.token_ids)
    for token in done.logprobs or ():
        assert math.isfinite(token.logprob) and token.logprob <= 0
        assert all(math.isfinite(lp) for _, lp in token.top_logprobs or ())


@FUZZ
@given(kwargs=params)
def test_any_sampling_parameters_are_refused_or_served(served, kwargs):
    kwargs.setdefault("max_tokens", 3)
    if isinstance(kwargs["max_tokens"], int) and not isinstance(kwargs["max_tokens"], bool):
        kwargs["max_tokens"] = min(kwargs["max_tokens"], 6)
    _call(served, "The fox", kwargs)


@FUZZ
@given(prompt=prompts)
def test_any_prompt_or_chat_is_refused_or_served(served, prompt):
    _call(served, prompt, {"max_tokens": 2, "temperature": 0.0})


def test_the_fuzzed_engine_still_serves_and_leaked_nothing(served):
    engine, loop, tally = served
    done = asyncio.run_coroutine_threadsafe(engine.generate("still here", max_tokens=3), loop).result(60)
    assert done.usage.completion_tokens >= 1
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["pages_free"] == stats["pages_total"]
    assert tally["served"] and tally["refused"]
