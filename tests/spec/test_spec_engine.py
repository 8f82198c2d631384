"""Speculative decoding through the engine, on the oracle model whose MSA drops blocks past 24 tokens: greedy
output with every drafter equals the output without; sampling rows and greedy rows, speculating and plain,
share batches; chunked prefill, preemption and the prefix cache change no token; rolled-back slots leak no page."""

import asyncio
import random

import pytest
from depth_helpers import sticky_random_depth

from m3sdk import Engine, SamplingParams
from m3sdk.cache.page_pool import pages_for
from m3sdk.config import EngineConfig
from m3sdk.core import build_core
from m3sdk.request import Request
from m3sdk.sampler import SamplingState
from m3sdk.speculative.depth import DraftDepth
from m3sdk.tokenizer import TextStream

MAX_TOKENS = 20


def prompts(seed: int) -> list[list[int]]:
    """Prompts of 29-70 tokens; half of them repeat a phrase, so n-gram drafts get accepted too."""
    rng = random.Random(seed)
    out = []
    for n in (29, 45, 61, 70, 33, 52):
        phrase = [rng.randrange(3, 256) for _ in range(7)]
        body = [rng.randrange(3, 256) for _ in range(n)]
        out.append(body if len(out) % 2 else (body[: n - 21] + phrase * 3))
    return out


def config(checkpoint, **overrides) -> dict:
    return {**dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                   max_num_batched_tokens=40, kv_cache_memory=1 << 22), **overrides}


async def greedy(checkpoint, ps, **overrides) -> tuple[list[list[int]], dict]:
    async with Engine(**config(checkpoint, **overrides)) as e:
        done = await asyncio.gather(*[e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                                      for p in ps])
        stats = e.stats()
    assert all(c.finish_reason == "length" for c in done)
    return [c.token_ids for c in done], stats


@pytest.fixture(scope="module")
def reference(spec_checkpoint):
    return asyncio.run(greedy(spec_checkpoint, prompts(0)))[0]


@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp"])
async def test_greedy_identical_with_each_drafter(spec_checkpoint, eagle3_head, reference, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(eagle3_head)
    out, stats = await greedy(spec_checkpoint, prompts(0), speculative=spec)
    assert out == reference
    assert stats["spec_method"] == method and stats["spec_drafted_tokens"] > 0
    assert stats["pages_free"] == stats["pages_total"]
    if method == "ngram":  # the repeated phrases are found and copied
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_target_forwards_per_token"] < 1
        assert stats["spec_mean_accepted_length"] > 1


async def test_preemption_prefix_cache_and_mixed_sampling(spec_checkpoint, reference):
    """A cache of 10 pages for 6 growing sequences (preemptions), a repeated prompt (prefix hits), sampled rows
    beside greedy ones: greedy tokens are unchanged."""
    ps = prompts(0)
    page_bytes = 4 * 2 * 2 * 16 * 16 * 4 + 2 * 16 * 16 * 4
    async with Engine(**config(spec_checkpoint, kv_cache_memory=10 * page_bytes, speculative="ngram")) as e:
        sampled = [e.generate(p, max_tokens=MAX_TOKENS, temperature=0.8, seed=i, ignore_eos=True)
                   for i, p in enumerate(ps[:2])]
        done = await asyncio.gather(*[e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                                      for p in ps], *sampled)
        again = await e.generate(ps[3], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        stats = e.stats()
    assert [c.token_ids for c in done[:6]] == reference and again.token_ids == reference[3]
    assert all(len(c.token_ids) == MAX_TOKENS for c in done[6:])
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_accepted_tokens"] > 0 and stats["pages_free"] == stats["pages_total"]


def test_rolled_back_slots_leave_no_page(spec_checkpoint):
    """Step by step: after every step no request holds a page past its committed tokens and the step in flight
    (launched, not read yet), and no draft is left in its tokens but that step's; at the end every page is free."""
    core = build_core(EngineConfig(**config(spec_checkpoint, enable_prefix_caching=False, speculative="ngram")))
    requests = []
    for i, p in enumerate(prompts(0)):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        r = Request(f"r{i}", p, params, len(p) + MAX_TOKENS)
        r.sampling, r.text = SamplingState(params, p), TextStream(core.tokenizer, params, p)
        core.scheduler.add(r)
        requests.append(r)
    while core.scheduler.num_running or core.scheduler.num_waiting:
        core.step()
        flight = ({s.request.request_id: s.num_new_tokens for s in core.executor.in_flight.plan.scheduled}
                  if core.executor.in_flight else {})
        for r in requests:
            if r.is_finished or r.num_computed_tokens == 0:
                continue
            n = flight.get(r.request_id, 0)
            assert len(core.cache.page_table(r)) == pages_for(r.num_computed_tokens + n)
            if r.num_computed_tokens >= r.num_prompt_tokens:
                assert r.num_tokens == r.num_computed_tokens + max(n, 1)  # the real tokens + the drafts in flight
    assert core.executor.spec.stats()["spec_accepted_tokens"] > 0
    assert core.cache.num_free_pages() == core.cache.num_pages


async def test_token_budget_that_cuts_drafts(spec_checkpoint, reference):
    """8 tokens a step for up to 6 decoding requests with 3 drafts each: the budget cuts drafts (only the
    scheduled ones are verified), tokens unchanged."""
    out, stats = await greedy(spec_checkpoint, prompts(0), max_num_batched_tokens=8,
                              speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert out == reference and stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["eagle3", "ngram", "mtp"])
async def test_greedy_identical_whatever_depth_each_step_takes(spec_checkpoint, eagle3_head, reference, method,
                                                               monkeypatch):
    """Each step's depth drawn at random from 0 .. k (0: a plain step, the drafter not run; a request switching
    depth mid-way, and resuming drafting after plain steps): greedy output equals the output without speculation,
    and every page is free at the end."""
    rng = random.Random(3)
    monkeypatch.setattr(DraftDepth, "choose", sticky_random_depth(rng))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(eagle3_head)
    out, stats = await greedy(spec_checkpoint, prompts(0), speculative=spec)
    assert out == reference
    by_depth = stats["spec_steps_by_depth"]
    assert len(by_depth) == 4 and all(n > 0 for n in by_depth)
    # depth-0 steps ran as the plain overlapped executor's
    assert stats["overlap_steps"] > 0
    assert stats["spec_drafted_tokens"] > 0 and stats["pages_free"] == stats["pages_total"]
    if method == "ngram":  # (the random heads' drafts are seldom right)
        assert stats["spec_accepted_tokens"] > 0

