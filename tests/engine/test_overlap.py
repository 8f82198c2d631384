"""Overlapped steps (EngineConfig.overlap_scheduling) change no output: greedy, seeded and penalized sampling,
logprobs, stop strings, max_tokens, aborts, preemption and the prefix cache give what the synchronous loop gives,
and every page ends free. On the CPU the overlap is only a structure (torch ops are synchronous); these tests
prove its bookkeeping: the host lags one step, and a request that finished drops its extra token."""

import asyncio
import random

import pytest

import m3sdk.core.overlap as overlap_module
import m3sdk.engine as engine_module
from m3sdk import Engine
from m3sdk.core import EngineCore, build_core, warm_up
from m3sdk.core.executor import OverlappedExecutor
from m3sdk.core.overlap import OverlapChoice
from m3sdk.request import Request
from m3sdk.runner import PLACEHOLDER
from m3sdk.sampler import SamplingState

PROMPT_LENS = (5, 30, 47, 61, 12, 38)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def engine(checkpoint, overlap: bool, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=32, kv_cache_memory=1 << 22, overlap_scheduling=overlap)
    return Engine(**{**config, **overrides})


def assert_all_pages_free(e: Engine) -> None:
    stats = e.stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["running"] == stats["waiting"] == 0
    assert all(n == 0 for n in e._core.cache.pool.ref_counts)


def outcome(c) -> tuple:
    logprobs = None if c.logprobs is None else [(t.token_id, t.logprob, t.top_logprobs) for t in c.logprobs]
    return c.token_ids, c.text, c.finish_reason, c.usage.completion_tokens, logprobs


def assert_same_outcomes(got: list[tuple], want: list[tuple]) -> None:
    """Tokens, texts and finishes equal; logprobs equal to 1e-3: a step's batch may hold other rows in either loop
    (arrival timing), and a GEMM of another row count rounds differently in the last bits."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:4] == w[:4]
        assert (g[4] is None) == (w[4] is None)
        for (gt, gv, gtop), (wt, wv, wtop) in zip(g[4] or [], w[4] or [], strict=True):
            assert gt == wt and abs(gv - wv) < 1e-3
            assert [i for i, _ in gtop or []] == [i for i, _ in wtop or []]
            assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(gtop or [], wtop or [], strict=True))


async def mixed_run(checkpoint, overlap: bool, stop: str, **overrides) -> tuple[list[tuple], dict]:
    ps = prompts(0)
    kinds = [dict(temperature=0, max_tokens=14, ignore_eos=True),
             dict(temperature=0, max_tokens=3, ignore_eos=True),  # finishes early: its next token is dropped
             dict(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True),
             dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
             dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=10, ignore_eos=True),
             dict(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True)]
    async with engine(checkpoint, overlap, **overrides) as e:
        assert e._core.config.overlap is overlap
        done = await asyncio.gather(*[e.generate(p, **k) for p, k in zip(ps, kinds, strict=True)])
        assert_all_pages_free(e)
        stats = e.stats()
    return [outcome(c) for c in done], stats


async def test_overlap_gives_the_same_outputs_as_the_synchronous_loop(engine_checkpoint):
    async with engine(engine_checkpoint, False) as e:  # a stop string that the third request's output contains
        ref = await e.generate(prompts(0)[2], temperature=0, max_tokens=20, ignore_eos=True)
    stop = ref.text[6:8]
    sync, sync_stats = await mixed_run(engine_checkpoint, False, stop)
    overlap, overlap_stats = await mixed_run(engine_checkpoint, True, stop)
    assert_same_outcomes(overlap, sync)
    assert sync[1][2] == "length" and len(sync[1][0]) == 3
    assert sync[2][2] == "stop" and len(sync[2][0]) < 20
    assert overlap_stats["generation_tokens"] == sync_stats["generation_tokens"]
    assert overlap_stats["requests_finished"] == 6


async def test_overlap_under_preemption_keeps_outputs_and_frees_every_page(engine_checkpoint):
    page_bytes = 4 * 2 * 2 * 16 * 16 * 4 + 2 * 16 * 16 * 4
    ps = prompts(1)
    runs = []
    for overlap in (False, True):
        async with engine(engine_checkpoint, overlap, kv_cache_memory=8 * page_bytes) as e:
            done = await asyncio.gather(*[e.generate(p, temperature=0, max_tokens=14, ignore_eos=True) for p in ps])
            assert e.stats()["preemptions"] > 0
            assert_all_pages_free(e)
        runs.append([c.token_ids for c in done])
    assert runs[0] == runs[1]


async def test_overlap_prefix_cache_commits_real_tokens(engine_checkpoint):
    """Pages committed while a later step is in flight hash the real tokens, not the placeholder: a prompt that
    repeats a finished request's prompt and output hits the cache past the prompt."""
    p = prompts(2)[3]  # 61 tokens
    async with engine(engine_checkpoint, True) as e:
        first = await e.generate(p, temperature=0, max_tokens=20, ignore_eos=True)
        again = await e.generate(p + first.token_ids, temperature=0, max_tokens=5, ignore_eos=True)
        assert_all_pages_free(e)
    assert again.usage.cached_prompt_tokens == 80  # 5 full pages: 61 prompt + 19 generated tokens written
    async with engine(engine_checkpoint, False, enable_prefix_caching=False) as e:
        ref = await e.generate(p + first.token_ids, temperature=0, max_tokens=5, ignore_eos=True)
    assert again.token_ids == ref.token_ids


async def test_overlap_aborts_free_every_page(engine_checkpoint):
    ps = prompts(3) * 4
    rng = random.Random(0)

    async def consume(e: Engine, p: list[int]) -> list[int]:
        got: list[int] = []
        stop_after = rng.randrange(0, 6)
        async for chunk in e.stream(p, temperature=0, max_tokens=12, ignore_eos=True):
            got += chunk.token_ids
            if len(got) > stop_after:
                break
        return got

    async with engine(engine_checkpoint, False) as e:
        full = [c.token_ids for c in await asyncio.gather(
            *[e.generate(p, temperature=0, max_tokens=12, ignore_eos=True) for p in ps])]
    async with engine(engine_checkpoint, True) as e:
        partial = await asyncio.gather(*[consume(e, p) for p in ps])
        for _ in range(100):  # the aborts reach the engine thread after the streams end
            if e.stats()["running"] == e.stats()["waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        assert_all_pages_free(e)
        assert e.stats()["requests_aborted"] > 0
    for got, ref in zip(partial, full, strict=True):
        assert got == ref[:len(got)]


def test_host_bookkeeping_lags_one_step(engine_checkpoint):
    """Driven by hand: the step that computes a prompt returns no token (it is still a placeholder); the next step
    returns it while its own token is in flight; a request that reached max_tokens drops the extra one."""
    from m3sdk import EngineConfig, SamplingParams
    from m3sdk.tokenizer import TextStream

    core = build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", dtype="float32",
                                         max_model_len=128, kv_cache_memory=1 << 22, overlap_scheduling=True))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = prompts(4)[1]
    request = Request("r", prompt, params, len(prompt) + 2)
    request.sampling = SamplingState(params, prompt)
    request.text = TextStream(core.tokenizer, params, prompt)
    core.scheduler.add(request)
    assert core.step() == []
    assert request.token_ids[-1] == PLACEHOLDER and request.num_tokens == len(prompt) + 1
    first = core.step()
    assert [c.finish_reason for c in first] == [None] and request.token_ids[-2] != PLACEHOLDER
    assert request.token_ids[-1] == PLACEHOLDER  # step 2's token, in flight
    last = core.step()  # reads the second token (length), while a third step ran for it: dropped
    assert [c.finish_reason for c in last] == ["length"] and request.num_output_tokens == 2
    assert PLACEHOLDER not in request.token_ids
    assert core.step() == []
    assert core.cache.stats()["pages_free"] == core.cache.stats()["pages_total"]


def _drive(core: EngineCore, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy request through core.step() by hand; its output tokens."""
    from m3sdk import SamplingParams
    from m3sdk.tokenizer import TextStream

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = Request("mine", prompt, params, len(prompt) + max_tokens)
    request.sampling = SamplingState(params, prompt)
    request.text = TextStream(core.tokenizer, params, prompt)
    core.scheduler.add(request)
    while not request.is_finished or core.executor.busy:
        core.step()
    return request.token_ids[len(prompt):]


def test_warm_up_leaves_the_engine_clean(engine_checkpoint):
    """warm_up (run by build_core on a GPU) serves its waves to the end: nothing running or in flight, every
    page free (its pages idle in the prefix cache), counters at zero, and the next request's tokens unchanged."""
    from m3sdk import EngineConfig

    def build() -> EngineCore:
        return build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", dtype="float32",
                                             max_model_len=128, kv_cache_memory=1 << 22, overlap_scheduling=True))

    prompt = prompts(5)[3]
    ref = _drive(build(), prompt, 8)
    core = build()
    warm_up(core, prompt_len=40, batches=(1, 3))
    stats = core.stats()
    assert stats["steps"] == stats["generation_tokens"] == stats["requests_finished"] == 0
    assert stats["running"] == stats["waiting"] == 0 and not core.executor.busy
    assert stats["pages_free"] == stats["pages_total"] and stats["pages_cached"] == 4 * 2  # 4 prompts x 2 pages
    assert stats["prefix_cache_hits"] == 4 * 16  # each repeated prompt: its first page hit, the last 16 prefilled
    assert all(n == 0 for n in core.cache.pool.ref_counts)
    assert core.warm_up_seconds > 0
    assert _drive(core, prompt, 8) == ref


@pytest.mark.gpu  # the overlapped path's pinned copies and events need CUDA
async def test_overlap_on_the_gpu_gives_the_synchronous_tokens(monkeypatch):
    """On a GPU the host really runs ahead of the stream (pinned uploads, the sampled tokens' copy and event, graph
    buffers written for N+1 while N replays): m3-tiny in float32 (near-ties are rare) gives the same greedy tokens
    with and without overlap, for requests that finish at different steps (so the batches differ: a finished
    request rides one step more)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # fp32 tl.dot is TF32 by default: bf16-like rounding
    rng = random.Random(7)
    ps = [[rng.randrange(2, 2048) for _ in range(rng.randrange(8, 300))] for _ in range(8)]
    lens = [rng.randrange(4, 48) for _ in ps]
    runs = []
    for overlap in (False, True):
        async with Engine(model="m3-tiny", device="cuda", dtype="float32", max_model_len=384, max_num_seqs=8,
                          kv_cache_memory=1 << 28, overlap_scheduling=overlap) as e:
            done = await asyncio.gather(*[e.generate(p, temperature=0, max_tokens=n, ignore_eos=True)
                                          for p, n in zip(ps, lens, strict=True)])
            assert_all_pages_free(e)
        runs.append([c.token_ids for c in done])
    assert runs[1] == runs[0]


async def test_steps_that_overlap_or_read_first_in_any_order_give_the_synchronous_outputs(engine_checkpoint,
                                                                                          monkeypatch):
    """The default on a GPU (`OverlapChoice`): each step overlaps or reads the step before first, whichever
    measured faster; drawn at random here, greedy rows (logprobs, a stop string, early finishes) and a penalized
    one give the synchronous loop's outputs, and every page ends free."""
    async with engine(engine_checkpoint, False) as e:
        ref = await e.generate(prompts(0)[2], temperature=0, max_tokens=20, ignore_eos=True)
    stop = ref.text[6:8]
    kinds = [dict(max_tokens=24), dict(max_tokens=3), dict(max_tokens=20, stop=[stop]),
             dict(max_tokens=30, logprobs=2), dict(max_tokens=4, repetition_penalty=1.3), dict(max_tokens=17)]

    async def run(overlap: bool) -> tuple[list[tuple], dict]:
        async with engine(engine_checkpoint, overlap) as e:
            done = await asyncio.gather(*[e.generate(p, temperature=0, ignore_eos=True, **k)
                                          for p, k in zip(prompts(0), kinds, strict=True)])
            assert_all_pages_free(e)
            return [outcome(c) for c in done], e.stats()

    sync, _ = await run(False)
    rng = random.Random(5)
    monkeypatch.setattr(OverlapChoice, "overlap", lambda self, batch: rng.random() < 0.5)
    real = build_core

    def with_choice(config, observers=()):
        core = real(config, observers)
        ex = core.executor
        core.executor = OverlappedExecutor(ex.runner, ex.scheduler, ex.sampler, OverlapChoice([1, 2, 4, 8]))
        return core

    monkeypatch.setattr(engine_module, "build_core", with_choice)
    mixed, stats = await run(True)
    assert_same_outcomes(mixed, sync)
    assert stats["overlap_steps"] > 3 and stats["read_first_steps"] > 3


def test_overlap_choice_follows_the_measured_periods():
    """Both kinds are measured at a batch bucket in alternating pairs of steps (overlap first), then overlap wins
    only by the margin, reading first otherwise; periods of steps with a prefill chunk, across a switch of kind or
    across an idle wait do not count."""
    for read_first, overlapped, want in ((0.4, 0.6, False), (0.6, 0.4, True), (0.4, 0.39, False),
                                         (0.4, 0.37, True)):
        choice, now, seen = OverlapChoice([1, 8]), 0.0, []
        for _ in range(40):
            kind = choice.overlap(8)
            choice.launched(now, 8, kind, clean=True)
            now += overlapped if kind else read_first
            seen.append(kind)
        assert seen[:16] == [True, True, False, False] * 4  # each kind's period needs two steps of it
        assert seen[-20:] == [want] * 20
        assert choice.overlap(1) is True  # batch 1 not measured yet: overlap first
    choice = OverlapChoice([4])
    choice.launched(0.0, 4, True, clean=False)
    choice.launched(1.0, 4, True, clean=True)
    choice.idle()
    choice.launched(9.0, 4, True, clean=True)
    choice.launched(10.0, 4, False, clean=True)
    assert choice.costs.samples(4, 1) == choice.costs.samples(4, 0) == 0


def test_overlap_choice_measures_the_other_kind_again(monkeypatch):
    """Read first wins at first; when overlapping becomes the faster kind later (the first wave's prefills are
    done, say), the choice finds out at its next re-measurement and switches."""
    monkeypatch.setattr(overlap_module, "REMEASURE_EVERY", 50)
    choice, now, seen = OverlapChoice([8]), 0.0, []
    periods = {True: 0.6, False: 0.4}
    for step in range(200):
        if step == 60:
            periods[True] = 0.2
        kind = choice.overlap(8)
        choice.launched(now, 8, kind, clean=True)
        now += periods[kind]
        seen.append(kind)
    assert seen[20:50] == [False] * 30  # read first chosen, overlap not run again until the re-measurement
    assert seen[-40:] == [True] * 40
